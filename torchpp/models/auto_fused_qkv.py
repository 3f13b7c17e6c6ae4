"""plan="auto"'s fused query/key/value projections of unequal parts (multi-query and grouped-query
attention: StarCoder's ``c_attn`` [q | k | v], Falcon's ``query_key_value``): where a column split
of such a reader fails the split check, the check tries it split head by head
(``torchpp.tensor_parallel.fused_qkv``: each rank its query heads and the key/value heads they
read, copied where the ranks outnumber them), in blocks and grouped per key/value head, and keeps
the arrangement whose result equals the unsplit layer's. With query heads the TP size does not
divide, no arrangement is tried: the attention stays whole, for the reason the column split gave."""
from __future__ import annotations

from typing import Dict, List

from torch import nn

FUSED_QKV_STYLES = ("packed_qkv_colwise", "packed_qkv_grouped_colwise")
QUERY_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KEY_VALUE_HEADS = ("num_key_value_heads", "num_kv_heads")


def fused_qkv_variants(layer: nn.Module, group: Dict[str, str], ctx) -> List[Dict[str, str]]:
    """``group`` with its column-split readers whose width is the context's query heads plus as many
    key as value heads (fewer than the queries) split as fused q/k/v, once per arrangement."""
    heads, head_dim, size = ctx.num_heads, ctx.head_dim, ctx.size
    if not heads or not head_dim or heads % size:
        return []
    fused = []
    for name, style in group.items():
        parent, _, leaf = name.rpartition(".")
        module = getattr(layer.get_submodule(parent) if parent else layer, leaf, None)  # a per-head vector: no module
        if style != "colwise" or not isinstance(module, nn.Module) or getattr(module, "weight", None) is None \
                or module.weight.dim() != 2:  # experts' linears hold no fused q/k/v
            continue
        width = module.weight.shape[0] if isinstance(module, nn.Linear) else module.weight.shape[-1]
        kv, odd = divmod(width // head_dim - heads, 2)
        if not width % head_dim and not odd and 1 <= kv < heads and not heads % kv and not (kv % size and size % kv):
            fused.append(name)
    return [{**group, **{name: style for name in fused}} for style in FUSED_QKV_STYLES] if fused else []


def local_key_value_counts(module: nn.Module, size: int) -> None:
    """A split attention module's key/value counts on a rank holding one copied key/value head (the
    ranks outnumber them): one key/value head, and as many query heads per key/value head as it
    holds query heads (called after its head counts were divided)."""
    for attribute in KEY_VALUE_HEADS:
        value = getattr(module, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < size and not size % value:
            setattr(module, attribute, 1)
    local_heads = next((getattr(module, a) for a in QUERY_HEADS if isinstance(getattr(module, a, None), int)), None)
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(groups, int) and local_heads:
        module.num_key_value_groups = min(groups, local_heads)
