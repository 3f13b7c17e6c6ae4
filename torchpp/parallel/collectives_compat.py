"""torch.distributed's single-tensor collectives under the names each supported torch has:
torch 2.13 calls them ``all_gather_single`` and ``reduce_scatter_single`` (and deprecates
``all_gather_into_tensor`` and ``reduce_scatter_tensor``); torch 2.11 and 2.12 have only the old
names. Same arguments either way."""
import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
