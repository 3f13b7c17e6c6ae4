"""A small Megatron-core GPTModel (rope, local layer spec, fp64) for the drop-in's tests: built
whole for a one-process reference or as this rank's TP/PP chunks with the reference's weights,
and run by a schedule function (Megatron's or torchpp's) over fixed microbatches."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

VOCAB, HIDDEN, HEADS, FFN, LAYERS, SEQ, MBS = 32, 16, 4, 32, 4, 8, 2


class ConfigLayerNorm(nn.LayerNorm):
    """torch's LayerNorm in config.params_dtype, flagged for Megatron's sequence parallelism
    (the local spec's torch norm takes the default dtype and refuses sequence parallelism;
    apex's is not installed here)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def init_megatron(tp: int, pp: int, vp: Optional[int] = None) -> None:
    """(Re)initialises Megatron's parallel state on the pool's ranks."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp, create_gloo_process_groups=False)


def make_config(tp: int, pp: int, vp: Optional[int] = None, sp: bool = False, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    options = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                   use_cpu_initialization=True, params_dtype=torch.float64, pipeline_dtype=torch.float64,
                   tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                   virtual_pipeline_model_parallel_size=vp, sequence_parallel=sp, hidden_dropout=0.0,
                   attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
                   gradient_accumulation_fusion=False, apply_rope_fusion=False)
    options.update(overrides)
    if options.get("variable_seq_lengths"):
        options["moe_token_dispatcher_type"] = "alltoall"  # its check applies without experts too
    return TransformerConfig(**options)


def _layer_spec(config, vp_stage):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = ConfigLayerNorm
    spec.submodules.pre_mlp_layernorm = ConfigLayerNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=ConfigLayerNorm)


def build_chunks(config, tied: bool = True, seed: int = 0) -> List[nn.Module]:
    """This rank's model chunks under Megatron's parallel state (one per virtual stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vp or 1):
        chunk = GPTModel(config=config, transformer_layer_spec=_layer_spec(config, stage if vp else None),
                         vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage if vp else None),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage if vp else None),
                         position_embedding_type="rope", vp_stage=stage if vp else None)
        chunks.append(chunk)
    return chunks


def global_name(chunk: nn.Module, name: str, tied: bool) -> str:
    """The name of a chunk's parameter in the whole (one-process) model."""
    inner = chunk.module if hasattr(chunk, "ddp_config") else chunk
    parts = name.split(".")
    if parts[0] == "module":
        parts = parts[1:]
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(inner.decoder.layers[int(parts[2])].layer_number - 1)
    if tied and parts == ["output_layer", "weight"]:
        parts = ["embedding", "word_embeddings", "weight"]
    return ".".join(parts)


def shard_of(param: torch.Tensor, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of a whole tensor, as Megatron splits ``param``."""
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        return full.chunk(tp, dim=param.partition_dim)[tp_rank]
    return full


def load_reference(chunks: List[nn.Module], reference: Dict[str, torch.Tensor], tied: bool) -> None:
    """Copies the whole model's weights into this rank's shards."""
    from megatron.core import parallel_state as ps

    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                param.copy_(shard_of(param, reference[global_name(chunk, name, tied)], tp_rank, tp))


def make_batches(m: int, seed: int = 1, seq_lens=None) -> List[torch.Tensor]:
    """m microbatches of token ids [MBS, s + 1] (inputs and shifted labels)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = seq_lens or [SEQ] * m
    return [torch.randint(0, VOCAB, (MBS, s + 1), generator=generator) for s in lengths]


def forward_step(data_iterator, model):
    """Megatron's forward_step_func contract: (output, loss_func); every stage reads its batch.
    The loss is the fp64 vocabulary-parallel cross entropy (Megatron's own computes in fp32)."""
    from megatron.core import parallel_state as ps

    from torchpp.tensor_parallel import vocab_parallel_cross_entropy

    batch = next(data_iterator)
    ids, labels = batch[:, :-1], batch[:, 1:]
    s = ids.shape[1]
    positions = torch.arange(s).unsqueeze(0).expand_as(ids)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(ids.shape[0], 1, s, s)  # True: masked
    output = model(ids, positions, causal)

    def loss_func(logits):
        loss = vocab_parallel_cross_entropy(logits, labels, ps.get_tensor_model_parallel_group(), reduction="mean")
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def run_schedule(func, chunks, batches, m: int, forward_only: bool = False):
    """One step of ``func``; returns the loss dicts' losses (floats)."""
    vp = len(chunks)
    iterators = [iter(batches) for _ in range(vp)] if vp > 1 else iter(batches)
    stored = func(forward_step_func=forward_step, data_iterator=iterators, model=chunks if vp > 1 else chunks,
                  num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, forward_only=forward_only)
    return [float(d["lm loss"]) for d in stored]


def grads_of(chunks: List[nn.Module], tied: bool) -> Dict[str, torch.Tensor]:
    """Each parameter's gradient (main_grad under Megatron's DDP), by its whole-model name."""
    out = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            out[global_name(chunk, name, tied) + ("@output" if name.endswith("output_layer.weight") else "")] = (
                None if grad is None else grad.detach().clone())
    return out
