"""destroy_parallel: a layout's groups (init_parallel's, the backward twins, groups made for it
later) are freed, so a process that changes layouts many times keeps a bounded number of gloo
threads; the next layout works and the default group survives."""
import os

import pytest
import torch
import torch.distributed as dist

import torchpp
from torchpp.parallel import new_layout_group
from torchpp.parallel.backward_groups import backward_twins


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _layout(i: int) -> torchpp.parallel.ParallelState:
    state = torchpp.init_parallel(tp=2, pp=1) if i % 2 else torchpp.init_parallel(tp=1, pp=2)
    backward_twins(state)
    new_layout_group(state, [0, 1])
    return state


def check_layouts_free_their_groups(cycles: int, device: str = "cpu"):
    baseline = None  # after the first layout: its collectives start threads that stay (gloo's, torch's)
    for i in range(cycles):
        state = _layout(i)
        total = torch.ones(1, device=device)
        dist.all_reduce(total, group=state.tp_group if state.tp > 1 else state.pp_group)
        assert total.item() == 2.0
        torchpp.destroy_parallel()
        with pytest.raises(RuntimeError, match="call torchpp.init_parallel"):
            torchpp.get_parallel_state()
        baseline = baseline or _threads()
    grown = _threads() - baseline
    # Each layout makes 7+ gloo groups with threads of their own; kept alive, 10 layouts would add ~100.
    assert grown <= 2, f"{grown} threads more after {cycles} layouts: their groups were not destroyed"
    total = torch.ones(1, device=device)
    dist.all_reduce(total)  # the default group is untouched
    assert total.item() == 2.0
    torchpp.destroy_parallel()  # nothing to destroy: no error


def test_destroy_parallel_frees_every_group_of_a_layout(ranks):
    ranks(2).run(check_layouts_free_their_groups, 10)
