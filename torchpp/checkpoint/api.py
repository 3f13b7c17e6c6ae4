"""save_checkpoint / load_checkpoint: a PTD-P training state through torch.distributed.checkpoint.

One checkpoint is one DCP directory. Keys (all layout-independent):
    model.{name}              parameter: DTensor of its TP shard (Shard(partition_dim) over
                              "tp", Replicate over "dp": DCP writes each replica once)
    optim.{name}.{key}        optimizer state (see torchpp.checkpoint.optimizer)
    hparams.{name}            the param group options of the parameter
    rng.pp{p}.tp{t}.dp{d}     per-rank RNG states (see torchpp.checkpoint.rng)
    grad_scaler               the fp16 loss scaler's state (the same on every rank)
    meta                      {"step": int, "extra": user object}
where {name} is the parameter's name in the unsharded, one-process model.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from torchpp.checkpoint import directory
from torchpp.checkpoint.checksums import record_checksums, verify_checksums
from torchpp.checkpoint.chunks import ChunkedTensor
from torchpp.checkpoint.layout import ModelLike, WholeLayout, as_dtensor, named_parameters, saved_whole, tp_partition
from torchpp.checkpoint.optimizer import _unwrap, optimizer_entries, optimizer_targets
from torchpp.checkpoint.planner import ChunkedLoadPlanner, ChunkedSavePlanner
from torchpp.checkpoint.rng import capture_rng, restore_rng, rng_key, source_key
from torchpp.parallel.groups import ParallelState, get_parallel_state

MODEL_PREFIX = "model."
META = "meta"
GRAD_SCALER = "grad_scaler"


@dataclass
class LoadedCheckpoint:
    """What load_checkpoint restored.

    Attributes:
        path: the checkpoint directory read.
        step: the step passed to save_checkpoint.
        extra: the `extra` object passed to save_checkpoint.
        rng_restored: False when the layout's tp or pp changed, so RNG streams were left as is.
    """

    path: str
    step: int
    extra: Any
    rng_restored: bool


def _enabled_scaler(grad_scaler, optimizer):
    """The loss scaler to save or load: the one given, else a DistributedOptimizer's own."""
    scaler = grad_scaler if grad_scaler is not None else getattr(optimizer, "grad_scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _param_sharding(optimizer):
    """The ZeRO-3 optimizer whose parameters exist only as shards between steps, else None:
    saving and loading gather them first (a checkpoint is the same whatever the ZeRO stage)."""
    inner = _unwrap(optimizer) if optimizer is not None else None
    return inner if getattr(inner, "shard_params", False) else None


def _model_entries(params, state: ParallelState, loading: bool = False):
    """DCP entries of the parameters, and {name: (parameter, full buffer)} for those saved whole
    (see saved_whole): after a load each takes its shard of the buffer."""
    entries, whole = {}, {}
    for name, p in params.items():
        if saved_whole(p, state):
            layout = WholeLayout(p, state)
            full = torch.empty(layout.full_shape(p.shape), dtype=p.dtype, device=p.device) \
                if loading else layout.gather(p)
            entries[MODEL_PREFIX + name] = as_dtensor(full, None, state)
            whole[name] = (p, full)
        else:
            entries[MODEL_PREFIX + name] = as_dtensor(p.detach(), tp_partition(p, state), state)
    return entries, whole


def save_checkpoint(
    root: str,
    step: int,
    model: ModelLike,
    optimizer=None,
    *,
    extra: Any = None,
    state: Optional[ParallelState] = None,
    grad_scaler=None,
) -> str:
    """Saves this rank's part of the training state to `root/step_{step}`, atomically.

    Collective: every rank of the world calls it with its own model part. Files are written
    to `root/step_{step}.tmp`; after all ranks finished, rank 0 renames the directory and
    points `root/latest` at it. An error or crash before the rename leaves the previous
    checkpoint as the latest; one after it leaves the new one, complete, which loading adopts.
    A `step_{step}` newer than the one `latest` names (an interrupted save's) is replaced.
    `root` must be one directory all ranks see (a shared file system).

    Args:
        root: directory of checkpoints.
        step: the training step (names the directory; each step is saved once).
        model: the module this rank holds, or {global name: parameter} for a pipeline stage
            (see stage_parameters), so names are those of the unsharded model.
        optimizer: a torch.optim optimizer, or a torchpp ZeroRedundancyOptimizer or
            DistributedOptimizer, over `model` (with post_validate, its pending update is
            validated first: ``flush()``).
        extra: any picklable object, equal on every rank (data position, LR scheduler state).
        state: the parallel layout (default: the one from torchpp.init_parallel).
        grad_scaler: an fp16 loss scaler (torch.amp.GradScaler); default: the optimizer's, if
            it is a DistributedOptimizer with one. Its scale and growth count are saved.

    Returns:
        The committed checkpoint directory.
    """
    staged = stage_state(step, model, optimizer, extra=extra, state=state, grad_scaler=grad_scaler)
    try:
        return write_staged(root, staged)
    finally:
        staged.release()


@dataclass
class StagedState:
    """A training state ready for DCP: entries, the chunked ones, and what to undo afterwards."""

    step: int
    entries: Dict[str, Any]
    chunked: Dict[str, ChunkedTensor]
    sharded: Any = None  # a ZeRO-3 optimizer whose gathered parameters are released afterwards

    def release(self) -> None:
        if self.sharded is not None:
            self.sharded.release_all_params()
            self.sharded = None


def _copy(value: Any) -> Any:
    """A copy of a state entry that later training steps cannot change."""
    if isinstance(value, DTensor):
        return DTensor.from_local(value.to_local().clone(), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    if isinstance(value, ChunkedTensor):
        return ChunkedTensor(value.global_shape, value.offsets, [t.clone() for t in value.tensors])
    if torch.is_tensor(value):
        return value.clone()
    return copy.deepcopy(value)


@torch.no_grad()
def stage_state(step: int, model: ModelLike, optimizer=None, *, extra: Any = None,
                state: Optional[ParallelState] = None, grad_scaler=None, copy_tensors: bool = False) -> StagedState:
    """This rank's training state as DCP entries (collective over TP and expert groups, which
    gather tensors saved whole). With `copy_tensors`, every entry is a copy, so training may go
    on while a background thread writes it (see AsyncCheckpointer). Arguments as save_checkpoint."""
    state = state or get_parallel_state()
    if getattr(optimizer, "post_validate", False):
        optimizer.flush()  # a speculative update is validated (and redone if need be) before it is saved
    params = named_parameters(model)
    sharded = _param_sharding(optimizer)
    if sharded is not None:
        sharded.gather_all_params()
    entries, _ = _model_entries(params, state)
    chunked: Dict[str, ChunkedTensor] = {}
    if optimizer is not None:
        plain, chunked = optimizer_entries(optimizer, params, state)
        entries.update(plain)
    entries[rng_key(state.pp_rank, state.tp_rank, state.dp_rank)] = capture_rng()
    scaler = _enabled_scaler(grad_scaler, optimizer)
    if scaler is not None:
        entries[GRAD_SCALER] = scaler.state_dict()
    entries[META] = {"step": step, "extra": extra}
    staged = StagedState(step, entries, chunked, sharded)
    if copy_tensors:
        staged = StagedState(step, {k: _copy(v) for k, v in entries.items()},
                             {k: _copy(v) for k, v in chunked.items()})
        if sharded is not None:
            sharded.release_all_params()
    return staged


def write_staged(root: str, staged: StagedState, group=None) -> str:
    """Writes a staged state to `root/step_N.tmp`, records every file's checksum and commits
    it as `root/step_N` (see save_checkpoint). Collective over `group` (default: the world);
    it runs no other collective, so a background thread may call it on a group of its own."""
    tmp = directory.on_rank0(lambda: directory.prepare(root, staged.step), group=group)
    dcp.save(staged.entries, storage_writer=dcp.FileSystemWriter(tmp), planner=ChunkedSavePlanner(staged.chunked),
             process_group=group)
    dist.barrier(group=group)  # every rank's files are complete before they are checksummed and committed
    checksums = record_checksums(tmp, group)
    return directory.on_rank0(lambda: directory.commit(root, staged.step, checksums), group=group)


@torch.no_grad()
def load_checkpoint(
    root: str,
    model: ModelLike,
    optimizer=None,
    *,
    step: Optional[int] = None,
    state: Optional[ParallelState] = None,
    grad_scaler=None,
    verify: bool = True,
) -> LoadedCheckpoint:
    """Loads a checkpoint into this rank's model part (and optimizer), in place.

    The saving run's (tp, pp, dp) and ZeRO stage need not match this one: every tensor is read
    as this rank's part of the unsharded tensor. Collective over the world.

    Args:
        root: directory of checkpoints (as given to save_checkpoint).
        model: the module this rank holds, or {global name: parameter} (see stage_parameters).
        optimizer: a torch.optim optimizer, ZeroRedundancyOptimizer or DistributedOptimizer over
            `model`; its state
            is replaced by the saved one (parameters without saved state keep none).
        step: which step to load; default: the latest (the one `root/latest` names, or a newer
            complete step directory that a save which died before replacing `latest` left:
            see latest_checkpoint). A step that does not exist raises FileNotFoundError naming
            the steps that do; an incomplete directory raises IncompleteCheckpointError.
        state: the parallel layout (default: the one from torchpp.init_parallel).
        grad_scaler: the fp16 loss scaler to restore (default: the optimizer's, if it is a
            DistributedOptimizer with one); a checkpoint saved without one leaves it as is, with
            a warning.
        verify: check every file against the checksum recorded when it was saved, before
            anything is read (each rank reads its share of the files once more): a file that
            differs raises CorruptCheckpointError on every rank, naming it, and nothing is
            loaded. False skips the check (a missing or short file is still refused).

    Returns:
        A LoadedCheckpoint with the step, the `extra` object and whether RNG was restored.
    """
    state = state or get_parallel_state()
    # Rank 0 chooses, so every rank reads the same directory or raises the same error.
    path = directory.on_rank0(lambda: directory.checkpoint_to_load(root, step, check=False), keep_type=True)
    if not (verify and verify_checksums(path)):  # checksums passed: every file is as it was committed
        if verify:
            warnings.warn(f"torchpp.checkpoint: {path} records no checksums (saved by an older torchpp); its files "
                          f"are not verified")
        directory.on_rank0(lambda: directory.check_complete(path), keep_type=True)
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    params = named_parameters(model)
    missing = [name for name in params if MODEL_PREFIX + name not in metadata.state_dict_metadata]
    if missing:
        raise KeyError(f"torchpp.checkpoint: {path} has no parameters {missing}")
    sharded = _param_sharding(optimizer)
    if sharded is not None:
        sharded.gather_all_params()  # storage for the loaded values (the gathered ones are overwritten)
    entries, whole = _model_entries(params, state, loading=True)
    chunked: Dict[str, ChunkedTensor] = {}
    targets = None
    if optimizer is not None:
        targets = optimizer_targets(optimizer, params, state, metadata)
        entries.update(targets.plain)
        chunked = targets.chunked
    rng = source_key(metadata.state_dict_metadata, state)
    if rng is not None:
        entries[rng] = None
    scaler = _enabled_scaler(grad_scaler, optimizer)
    if scaler is not None and GRAD_SCALER in metadata.state_dict_metadata:
        entries[GRAD_SCALER] = None
    elif scaler is not None:
        warnings.warn(f"torchpp.checkpoint: {path} holds no loss scaler state; the grad scaler keeps its scale "
                      f"{scaler.get_scale()}")
    entries[META] = None
    dcp.load(entries, storage_reader=reader, planner=ChunkedLoadPlanner(chunked))
    for param, full in whole.values():
        param.copy_(WholeLayout(param, state).shard(full))
    if sharded is not None:
        sharded.keep_loaded_params()
    if targets is not None:
        targets.plain.update({k: entries[k] for k in targets.plain})  # objects were read into `entries`
        targets.install(optimizer)
    if entries.get(GRAD_SCALER) is not None:
        scaler.load_state_dict(entries[GRAD_SCALER])
    if rng is not None:
        restore_rng(entries[rng])
    else:
        warnings.warn(f"torchpp.checkpoint: {path} was saved under another tp or pp; RNG states were not restored")
    meta = entries[META]
    return LoadedCheckpoint(path=path, step=meta["step"], extra=meta["extra"], rng_restored=rng is not None)
