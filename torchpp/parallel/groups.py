"""Process groups for dp x pp x cp x tp (and expert parallelism), built from torchrun's environment.

Ranks are laid out with the first name of `order` varying fastest. Megatron's default,
"tp-cp-dp-pp", keeps a TP group on consecutive ranks (inside one node, where the bandwidth is),
context-parallel ranks next (they exchange keys/values every layer), and puts pipeline stages
furthest apart (across nodes). An order without cp (e.g. the older "tp-dp-pp") is accepted
while cp = 1. The groups come from one `torch.distributed.device_mesh.DeviceMesh` with dims
("pp", "dp", "cp", "tp"), so torchpp and DTensor-based code share the same communicators.

Expert parallelism (ep) does not add ranks: as in Megatron, the dp x cp ranks of one (pp, tp)
coordinate, taken dp-major, fall into groups of ep consecutive ranks that split the experts
between them (``ep_group``); the ranks holding the same experts (one per ep group, dp*cp/ep of
them) reduce the experts' gradients (``expert_dp_group``).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchpp.parallel.device_check import check_one_rank_per_device

MESH_DIMS = ("pp", "dp", "cp", "tp")
DEFAULT_ORDER = "tp-cp-dp-pp"


@dataclass
class ParallelState:
    """This rank's place in the dp x pp x cp x tp layout and the groups that serve it."""

    tp: int
    pp: int
    dp: int
    order: str
    mesh: DeviceMesh
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    # Ranks with this rank's dp and cp coordinates (pp x tp): each parameter once (for norms).
    model_parallel_group: dist.ProcessGroup
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    cp_group: Optional[dist.ProcessGroup] = None
    # Ranks with this rank's pp and tp coordinates (Megatron's dp-cp group): replicated
    # parameters' gradients are summed over cp and averaged over dp across it. dp_group if cp = 1.
    dp_cp_group: Optional[dist.ProcessGroup] = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Expert parallelism: ep ranks among the dp x cp ones split the experts (None while ep = 1);
    # expert_dp_group: the dp*cp/ep ranks holding this rank's experts (dp_cp_group while ep = 1).
    ep: int = 1
    ep_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None
    expert_dp_group: Optional[dist.ProcessGroup] = None
    # Groups made for this layout after init_parallel (backward twins, pipeline end ranks):
    # destroy_parallel frees them with the rest.
    owned_groups: List[dist.ProcessGroup] = field(default_factory=list, repr=False)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def groups(self) -> Dict[str, dist.ProcessGroup]:
        return {"tp": self.tp_group, "pp": self.pp_group, "dp": self.dp_group, "cp": self.cp_group,
                "dp_cp": self.dp_cp_group, "mp": self.model_parallel_group, "ep": self.ep_group,
                "expert_dp": self.expert_dp_group}


_STATE: Optional[ParallelState] = None


def mesh_grid(tp: int, pp: int, dp: int, cp: int = 1, order: str = DEFAULT_ORDER) -> torch.Tensor:
    """The [pp, dp, cp, tp] tensor of global ranks for a layout whose `order` lists dims fastest first."""
    names = order.split("-")
    if "cp" not in names and cp == 1:
        names.insert(1 if names[:1] == ["tp"] else 0, "cp")  # a size-1 dim varies nowhere
    if sorted(names) != sorted(MESH_DIMS):
        missing = "" if "cp" in names else f"; with cp={cp} it must place cp too (e.g. 'tp-cp-dp-pp')"
        raise ValueError(f"torchpp: order {order!r} must name each of tp, cp, dp, pp once, fastest first "
                         f"(e.g. 'tp-cp-dp-pp'; cp may be left out while cp = 1){missing}")
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp}
    strides, stride = {}, 1
    for name in names:
        strides[name] = stride
        stride *= sizes[name]
    p, d, c, t = torch.meshgrid(torch.arange(pp), torch.arange(dp), torch.arange(cp), torch.arange(tp), indexing="ij")
    return p * strides["pp"] + d * strides["dp"] + c * strides["cp"] + t * strides["tp"]


def rank_grid(tp: int, pp: int, dp: int, order: str = DEFAULT_ORDER) -> torch.Tensor:
    """The [pp, dp, tp] tensor of global ranks of a layout without context parallelism (cp = 1)."""
    return mesh_grid(tp, pp, dp, 1, order)[:, :, 0, :]


def _validate(world: int, tp: int, pp: int, cp: int, dp: Optional[int], num_heads, num_layers) -> int:
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if value < 1:
            raise ValueError(f"torchpp: {name}={value} must be at least 1")
    names, sizes = ("tp*pp*cp", f"{tp}*{pp}*{cp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
    model = tp * pp * cp
    if world % model:
        raise ValueError(f"torchpp: world size {world} is not divisible by {names} = {sizes} = {model}")
    if dp is None:
        dp = world // model
    if model * dp != world:
        raise ValueError(f"torchpp: {names}*dp = {sizes}*{dp} = {model * dp} does not equal the world size {world}")
    if num_heads is not None and (tp > num_heads or num_heads % tp):
        raise ValueError(f"torchpp: tp={tp} must divide the number of attention heads {num_heads}")
    if num_layers is not None and pp > num_layers:
        raise ValueError(f"torchpp: pp={pp} is larger than the number of layers {num_layers}")
    return dp


def _validate_ep(ep: int, dp: int, cp: int) -> None:
    if ep < 1:
        raise ValueError(f"torchpp: ep={ep} must be at least 1")
    if (dp * cp) % ep:
        raise ValueError(f"torchpp: ep={ep} must divide dp*cp = {dp}*{cp} = {dp * cp} (expert-parallel ranks are "
                         f"data/context-parallel ranks that split the experts between them)")


def expert_groups_ranks(grid: torch.Tensor, ep: int) -> List[tuple]:
    """[(ep ranks, expert-dp ranks)] lists for every (pp, tp) coordinate of the [pp, dp, cp, tp]
    grid: its dp x cp ranks (dp-major) cut into consecutive groups of ep, and the ranks at the
    same place in each of those groups."""
    out = []
    for p in range(grid.size(0)):
        for t in range(grid.size(3)):
            flat = grid[p, :, :, t].flatten().tolist()
            eps = [flat[i:i + ep] for i in range(0, len(flat), ep)]
            edps = [flat[i::ep] for i in range(ep)]
            out.append((eps, edps))
    return out


def _default_device() -> torch.device:
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.accelerator.device_count()
        torch.accelerator.set_device_index(index)
        return torch.device(accelerator.type, index)
    return torch.device("cpu")


def _check_restart_store() -> None:
    """A torchrun restart whose workers share the agent's rendezvous store finds the previous
    attempt's addresses there (pytorch/pytorch#135712) and fails to connect, or hangs: say so."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            f"torchpp: this is restart {restart} of a torchrun job whose workers share the agent's rendezvous "
            f"TCPStore, which still holds the previous attempt's addresses (pytorch/pytorch#135712); start torchrun "
            f"with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment so that each attempt gets a store of its "
            f"own (docs/training.md, 'Restarts that lose nothing')")


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    dp: Optional[int] = None,
    *,
    cp: int = 1,
    order: str = DEFAULT_ORDER,
    backend: Optional[str] = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    num_heads: Optional[int] = None,
    num_layers: Optional[int] = None,
    ep: int = 1,
) -> ParallelState:
    """Initialises torch.distributed (from torchrun's environment, if not yet done) and the
    dp x pp x cp x tp groups.

    Args:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        dp: data-parallel size; inferred as world_size / (tp * pp * cp) when None.
        cp: context-parallel size (the sequence split over cp ranks; see torchpp.context_parallel).
        order: dims from fastest- to slowest-varying rank, default "tp-cp-dp-pp" (Megatron's);
            an order without cp (e.g. "tp-dp-pp") is accepted while cp = 1.
        backend: process group backend; default nccl on CUDA, gloo otherwise.
        timeout: collective timeout, after which a would-be hang raises.
        num_heads: when given, checked to be divisible by tp.
        num_layers: when given, checked to be at least pp.
        ep: expert-parallel size: ep of the dp x cp ranks split the experts (it must divide
            dp*cp); see ``torchpp.expert_parallel``.

    Returns:
        The ParallelState, also available later from get_parallel_state().
    """
    global _STATE
    device = _default_device()
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if device.type == "cuda" else "gloo"
        _check_restart_store()
        dist.init_process_group(backend, timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    if device.type == "cuda" and "nccl" in str(dist.get_backend()) and "LOCAL_WORLD_SIZE" in os.environ:
        check_one_rank_per_device(dist.distributed_c10d._get_default_store(), device, rank,
                                  int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["LOCAL_WORLD_SIZE"]))
    dp = _validate(world, tp, pp, cp, dp, num_heads, num_layers)
    _validate_ep(ep, dp, cp)
    grid = mesh_grid(tp, pp, dp, cp, order)
    mesh = DeviceMesh(device.type, grid, mesh_dim_names=MESH_DIMS)
    pp_rank, dp_rank, cp_rank, tp_rank = (grid == rank).nonzero()[0].tolist()
    # Every rank creates every group, in the same order. pp x tp per (dp, cp): each parameter once.
    model_parallel_group = None
    for d in range(dp):
        for c in range(cp):
            group = dist.new_group(sorted(grid[:, d, c, :].flatten().tolist()))
            if (d, c) == (dp_rank, cp_rank):
                model_parallel_group = group
    dp_group = mesh.get_group("dp")
    dp_cp_group = dp_group
    if cp > 1:  # dp x cp per (pp, tp): where replicated parameters' gradients are reduced
        for p in range(pp):
            for t in range(tp):
                group = dist.new_group(sorted(grid[p, :, :, t].flatten().tolist()))
                if (p, t) == (pp_rank, tp_rank):
                    dp_cp_group = group
    ep_group, expert_dp_group, ep_rank = None, dp_cp_group, 0
    if ep > 1:  # every rank creates every group, in the same order
        for eps, edps in expert_groups_ranks(grid, ep):
            for ranks in eps:
                group = dist.new_group(ranks)
                if rank in ranks:
                    ep_group, ep_rank = group, ranks.index(rank)
            for ranks in edps:
                group = dist.new_group(ranks)
                if rank in ranks:
                    expert_dp_group = group
    _STATE = ParallelState(
        tp=tp, pp=pp, dp=dp, order=order, mesh=mesh,
        tp_group=mesh.get_group("tp"), pp_group=mesh.get_group("pp"), dp_group=dp_group,
        model_parallel_group=model_parallel_group,
        tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, cp=cp, cp_rank=cp_rank, cp_group=mesh.get_group("cp"),
        dp_cp_group=dp_cp_group, device=device,
        ep=ep, ep_rank=ep_rank, ep_group=ep_group, expert_dp_group=expert_dp_group,
    )
    return _STATE


def new_layout_group(state: ParallelState, ranks: Optional[List[int]] = None, **kwargs):
    """``dist.new_group(ranks, **kwargs)``, owned by ``state``'s layout: destroy_parallel frees it.
    Collective like new_group: every rank creates every group, in the same order."""
    group = dist.new_group(ranks, **kwargs)
    if isinstance(group, dist.ProcessGroup):  # not GroupMember.NON_GROUP_MEMBER
        state.owned_groups.append(group)
    return group


def destroy_parallel() -> None:
    """Destroys the process groups of the current layout: init_parallel's and those torchpp made
    for it since (backward twins, pipeline end-rank groups); torch.distributed's default group
    stays. Call it on every rank before another init_parallel in the same process (as Megatron's
    destroy_model_parallel): each gloo group keeps threads and sockets alive until destroyed.
    Models wrapped for the layout cannot communicate afterwards; get_parallel_state() raises."""
    global _STATE
    from torchpp import _C  # the ops' registry of backward twins names groups being destroyed

    state, _STATE = _STATE, None
    if state is None or not dist.is_initialized():
        return
    for name in getattr(state, "_backward_twins", {}):
        _C.set_backward_group(name, "")
    default = dist.distributed_c10d._get_default_group()
    groups = [state.mesh.get_group(dim) for dim in MESH_DIMS]
    groups += [state.model_parallel_group, state.dp_cp_group, state.ep_group, state.expert_dp_group]
    groups += state.owned_groups
    done = set()
    for group in groups:  # the same order on every rank
        if isinstance(group, dist.ProcessGroup) and group is not default and group.group_name not in done:
            done.add(group.group_name)
            dist.destroy_process_group(group)
    state.owned_groups.clear()


def get_parallel_state() -> ParallelState:
    """The state built by init_parallel (raises when it was not called)."""
    if _STATE is None:
        raise RuntimeError("torchpp: call torchpp.init_parallel(tp=, pp=, cp=, dp=) first")
    return _STATE


def stage_ranks(state: ParallelState) -> List[int]:
    """Global ranks of this rank's pipeline group, in stage order."""
    return dist.get_process_group_ranks(state.pp_group)
