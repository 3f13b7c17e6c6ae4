"""Hugging Face checkpoints in and out of a wrapped model, each rank reading and writing only
its own tensors.

Built on the meta device, the HF model costs no memory and no initialisation; ``parallelize``
then gives each rank storage for its own shards only, and ``load_hf_weights`` cuts them out of
the checkpoint that ``save_pretrained`` wrote. ``save_hf_checkpoint`` writes one back, which
``from_pretrained`` reads, and so does ``load_hf_weights`` under any other layout::

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    wrapped = parallelize(model, schedule="zb-h1", state=state)   # outside the meta context
    load_hf_weights(wrapped, "checkpoints/llama")
    ...                                                           # train
    save_hf_checkpoint(wrapped, "checkpoints/llama-tuned")
"""
from __future__ import annotations

import copy
import json
import os
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from torchpp.checkpoint.directory import commit_directory, on_rank0, prepare_directory
from torchpp.models.hf_disk_format import on_disk_format
from torchpp.parallel.object_collectives import all_gather_objects

Checkpoint = Union[str, os.PathLike, Mapping[str, torch.Tensor]]


def materialize_meta(module: nn.Module, device: torch.device) -> bool:
    """Gives every meta parameter of ``module`` uninitialised storage on ``device``, in place:
    the same Parameter objects, so ties, TP flags and exports still point at them. Returns
    whether there was any."""
    found = False
    for param in module.parameters():  # each shared parameter once
        if param.is_meta:
            real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
            real.__dict__.update(param.__dict__)
            torch.utils.swap_tensors(param, real)
            found = True
    stale = [name for name, buffer in module.named_buffers() if buffer.is_meta]
    if stale:
        raise ValueError(f"torchpp.parallelize: buffers {stale} are still on the meta device; build the model "
                         f"on the meta device but call parallelize outside that context")
    return found


class _Reader:
    """Tensors by HF name from a state dict, a .safetensors / .bin file, or a save_pretrained folder
    (sharded or not); files are opened lazily and only the asked-for tensors are read."""

    def __init__(self, source: Checkpoint):
        self.source = source if isinstance(source, Mapping) else os.fspath(source)
        self._open: Dict[str, Tuple[List[str], Callable[[str], torch.Tensor]]] = {}
        if isinstance(source, Mapping):
            self.files = None
            return
        path = self.source
        if os.path.isfile(path):
            self.files = {name: path for name in self._opened(path)[0]}
            return
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if os.path.isfile(os.path.join(path, index)):
                with open(os.path.join(path, index)) as f:
                    weight_map = json.load(f)["weight_map"]
                self.files = {name: os.path.join(path, file) for name, file in weight_map.items()}
                return
        for single in ("model.safetensors", "pytorch_model.bin"):
            file = os.path.join(path, single)
            if os.path.isfile(file):
                self.files = {name: file for name in self._opened(file)[0]}
                return
        raise FileNotFoundError(f"torchpp.load_hf_weights: no checkpoint in {path!r} (expected model.safetensors, "
                                f"pytorch_model.bin or their .index.json)")

    def _opened(self, file: str) -> Tuple[List[str], Callable[[str], torch.Tensor]]:
        """(tensor names, reader) of one file, opened once."""
        if file not in self._open:
            if file.endswith(".safetensors"):
                from safetensors import safe_open

                handle = safe_open(file, framework="pt", device="cpu")
                self._open[file] = (list(handle.keys()), handle.get_tensor)
            else:
                tensors = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                self._open[file] = (list(tensors), tensors.__getitem__)
        return self._open[file]

    def __contains__(self, name: str) -> bool:
        return name in (self.source if self.files is None else self.files)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(f"torchpp.load_hf_weights: {name!r} is not in the checkpoint {self._where()}")
        return self.source[name] if self.files is None else self._opened(self.files[name])[1](name)

    def _where(self) -> str:
        return "state dict" if self.files is None else repr(self.source)


@torch.no_grad()
def load_hf_weights(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Copies this rank's shard of every parameter out of a checkpoint of the original model.

    Works on a model wrapped from the meta device (see the module docstring) and on one with
    real weights (overwritten). Local: no communication; each rank reads only the tensors of
    its own stages, its experts (expert parallelism), and cuts its TP shard by each parameter's ``tp_layout``. A tied head absent
    from the checkpoint (transformers does not save it) takes the embedding's tensor.

    Args:
        model: the model ``parallelize`` returned.
        checkpoint: a folder written by ``save_pretrained`` (``model.safetensors`` or
            ``pytorch_model.bin``, or their sharded ``.index.json``), one such file, or a state
            dict of the original model.
    """
    reader = _Reader(checkpoint)
    group = model.tp_group
    tp_size, tp_rank = group.size(), dist.get_rank(group)
    disk = on_disk_format(model.config)
    tied = getattr(model, "tied_names", {})
    filled = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in filled:  # a parameter tied on this rank is reached under both names
            continue
        key = name if name in reader or name not in tied else tied[name]
        full = disk.read(key, reader) if disk is not None and key not in reader else None
        full = reader[key] if full is None else full
        experts = getattr(param, "expert_parallel", None)  # (ep group, rank, size): this rank's experts first
        if experts is not None and full.size(0) == param.size(0) * experts[2]:
            full = full.narrow(0, experts[1] * param.size(0), param.size(0))
        layout = getattr(param, "tp_layout", None)
        expected = param.shape if layout is None or layout.dim is None else layout.full_shape(param.shape, tp_size)
        if full.shape != expected:
            raise ValueError(f"torchpp.load_hf_weights: {key} of shape {tuple(full.shape)} in the checkpoint, but the "
                             f"wrapped model's is {tuple(expected)} (shards of {tuple(param.shape)} on {tp_size} TP "
                             f"ranks): the checkpoint is not of this model's config")
        param.copy_(full if layout is None else layout.shard(full, tp_rank, tp_size))
        filled.add(id(param))
    model.weights_pending = False


@torch.no_grad()
def save_hf_checkpoint(model: nn.Module, directory: Union[str, os.PathLike],
                       dtype: Optional[torch.dtype] = None) -> str:
    """Writes the wrapped model as a Hugging Face checkpoint: ``config.json``, one safetensors
    file per pipeline rank (written by its first TP and data-parallel rank) and their
    ``model.safetensors.index.json``, as ``save_pretrained`` lays out a sharded checkpoint. A
    tied head is left out, as transformers does. Collective over every rank.

    Written to ``directory.tmp`` and renamed once every file is complete, so an interrupted
    save leaves nothing under ``directory``; it must not exist yet. Every rank must see the
    same file system.

    Args:
        model: the model ``parallelize`` returned.
        directory: where to write.
        dtype: cast the tensors to it (e.g. torch.bfloat16 from fp32 training), and record it
            in config.json; default: as they are.

    Returns:
        ``directory``.
    """
    from safetensors.torch import save_file

    state, final = model.state, os.fspath(directory)
    tmp = on_rank0(lambda: prepare_directory(final))
    tensors = model.full_state_dict()  # collective over TP
    if dtype is not None:
        tensors = {name: t.to(dtype) for name, t in tensors.items()}
    disk = on_disk_format(model.config)
    if disk is not None:  # the names (and splits) transformers writes
        tensors = {key: t for name, tensor in tensors.items() for key, t in disk.write(name, tensor).items()}
    tied = getattr(model, "tied_names", {})
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items() if name not in tied}
    held = all_gather_objects(sizes, state.pp_group)
    owned, claimed = [], set()
    for names in held:  # DualPipe: a stage's twin copy on a later pipeline rank is not written again
        owned.append(sorted(set(names) - claimed))
        claimed.update(names)
    writers = [k for k in range(state.pp) if owned[k]]
    file_of = {k: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, k in enumerate(writers)}
    if state.tp_rank == 0 and state.dp_rank == 0 and owned[state.pp_rank]:
        save_file({name: tensors[name].contiguous() for name in owned[state.pp_rank]},
                  os.path.join(tmp, file_of[state.pp_rank]), metadata={"format": "pt"})

    def write_index_and_commit() -> str:
        weight_map = {name: file_of[k] for k in writers for name in owned[k]}
        total = sum(held[k][name] for k in writers for name in owned[k])
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        config = model.config
        if dtype is not None:
            config = copy.deepcopy(config)
            config.dtype = dtype
        config.save_pretrained(tmp)
        return commit_directory(final)

    dist.barrier()  # every shard file is complete before the rename makes them the checkpoint
    return on_rank0(write_index_and_commit)
