"""torch.ops.torchpp given a wrong group or per-rank different tensors: a clear error on every rank.
So do context-parallel ranks given different batches, which once sent one rank into the ring
while the other all-gathered segment ids (rows packed on one rank only): gloo's timeout, 45 s on.

Without the check before each collective over gloo, tensors of different sizes on different
ranks abort the whole process inside gloo (SIGABRT: "Received data size doesn't match expected
size"); the harness then reports a rank that exited, and these tests fail.
"""
import pytest
import torch
import torch.distributed as dist

import torchpp.ops as O
from fault_utils import assert_outcomes, run_case

WITHIN_S = 10.0
UNKNOWN = "no_such_group"


def _ops_taking_a_group():
    """Every torch.ops.torchpp op with a group-name argument, and that argument's name."""
    found = {}
    # dir(torch.ops.torchpp) lists only the ops already looked up: ask the dispatcher instead.
    registered = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("torchpp::")}
    for name in sorted(registered):
        packet = getattr(torch.ops.torchpp, name)
        if not hasattr(packet, "default"):
            continue
        for argument in packet.default._schema.arguments:
            if str(argument.type) == "str" and "group" in argument.name:
                found[name] = argument.name
    return found


_QKV = (torch.ones(1, 2, 4, 4), torch.ones(1, 2, 4, 4), torch.ones(1, 2, 4, 4))
# order, send_counts, recv_counts: every pair to expert 0 (rank 0's).
_ROUTING = (torch.arange(8), torch.tensor([8, 0, 0, 0]), torch.tensor([[8, 0], [0, 0]]))
# How to call each op with the unknown group: (args before the name, args after it).
UNKNOWN_GROUP_CALLS = {
    "copy_to_tp_region": ((torch.ones(4, 8),), ()),
    "reduce_from_tp_region": ((torch.ones(4, 8),), ()),
    "scatter_to_tp_region": ((torch.ones(4, 8),), (2, -1)),
    "gather_from_tp_region": ((torch.ones(4, 8),), (2, -1)),
    "scatter_to_sp_region": ((torch.ones(4, 8),), (2, 0)),
    "gather_from_sp_region": ((torch.ones(4, 8),), (2, 0)),
    "reduce_scatter_to_sp_region": ((torch.ones(4, 8),), (2, 0)),
    # A slice that needs no all-gather (tp_size 1) must still name the bad group.
    "pp_gather_slices": ((torch.ones(8), [8]), (1,)),
    # Context-parallel attention on a [b, heads, s_local, d] shard (and its halves).
    "ring_attention": ((*_QKV, None), (2,)),
    "all_gather_attention": ((*_QKV, None), (2,)),
    "all_to_all_attention": ((*_QKV, None), (2,)),
    "all_to_all_ring_attention": ((*_QKV, None), (2, UNKNOWN, 1)),  # (the all-to-all group's name is checked first)
    "ring_attention_forward": ((*_QKV, None), (2, True, None, "zigzag")),
    "all_gather_attention_forward": ((*_QKV, None), (2, True, None, "zigzag")),
    "ring_attention_backward": ((_QKV[0], *_QKV, _QKV[0], torch.zeros(1, 2, 4), None), (2, True, None, "zigzag")),
    "all_gather_attention_backward": ((_QKV[0], *_QKV, _QKV[0], torch.zeros(1, 2, 4), None),
                                      (2, True, None, "zigzag")),
    # The all-to-all modes' exchanges of heads for the sequence.
    "heads_to_sequence": ((_QKV[0],), (2,)),
    "sequence_to_heads": ((_QKV[0],), (2,)),
    # Expert-parallel routing of 4 tokens x 2 slots over 4 experts (and the exchange's halves).
    "moe_route": ((torch.zeros(4, 2, dtype=torch.long), 4), (2,)),
    "moe_dispatch": ((torch.ones(4, 8), *_ROUTING, 2), (2,)),
    "moe_combine": ((torch.ones(8, 8), torch.ones(4, 2), *_ROUTING, 4), (2,)),
    "moe_undispatch": ((torch.ones(8, 8), *_ROUTING, 2, 4), (2,)),
    "moe_combine_forward": ((torch.ones(8, 8), torch.ones(4, 2), *_ROUTING, 4), (2,)),
    "moe_combine_backward": ((torch.ones(4, 8), torch.ones(8, 8), torch.ones(4, 2), *_ROUTING), (2,)),
}


def _unknown_group_everywhere():
    outcomes = {}
    for name, (before, after) in UNKNOWN_GROUP_CALLS.items():
        op = getattr(torch.ops.torchpp, name)
        outcomes[name] = run_case(lambda: op(*before, UNKNOWN, *after))
    outcomes["wrapper"] = run_case(lambda: O.gather_from_tp_region(torch.ones(2), UNKNOWN))
    return outcomes


def test_every_op_taking_a_group_is_covered():
    assert sorted(_ops_taking_a_group()) == sorted(UNKNOWN_GROUP_CALLS)


@pytest.fixture(scope="module")
def unknown_group(ranks):
    return ranks(2).run(_unknown_group_everywhere, timeout=60)


@pytest.mark.parametrize("name", sorted(UNKNOWN_GROUP_CALLS))
def test_unknown_group_name_is_refused_by_each_op(unknown_group, name):
    assert_outcomes([r[name] for r in unknown_group], "RuntimeError",
                    [f"unknown process group name '{UNKNOWN}'"], within_s=WITHIN_S)


def test_unknown_group_name_is_refused_by_the_python_wrappers(unknown_group):
    assert_outcomes([r["wrapper"] for r in unknown_group], "ValueError",
                    [f"unknown process group name '{UNKNOWN}'"], within_s=WITHIN_S)


def _backward(op, x, *args):
    x = x.clone().requires_grad_()
    op(x, *args).sum().backward()


# kind: what every rank runs on its tensor x (rank 0: [4, 8] Float, rank 1: a variant's), and
# the tensor that op's collective actually moves (named in the message).
MISMATCHES = {
    "reduce_from_tp_region": (lambda g, x: O.reduce_from_tp_region(x, g), lambda x: x),
    "copy_to_tp_region backward": (lambda g, x: _backward(O.copy_to_tp_region, x, g), lambda x: x),
    "gather_from_tp_region": (lambda g, x: O.gather_from_tp_region(x, g), lambda x: x),
    "gather_from_sp_region": (lambda g, x: O.gather_from_sp_region(x, g), lambda x: x),
    "scatter_to_tp_region backward": (lambda g, x: _backward(O.scatter_to_tp_region, x, g),
                                      lambda x: x[:, : x.shape[1] // 2]),  # the gradient of this rank's half
    "reduce_scatter_to_sp_region": (lambda g, x: O.reduce_scatter_to_sp_region(x, g), lambda x: x),
    "pp_gather_slices": (lambda g, x: torch.ops.torchpp.pp_gather_slices(x.flatten(), [x.numel() * 2], g.group_name, 2),
                         lambda x: x.flatten()),
}
# A mapping's backward is its conjugate op (called through the dispatcher): the message names it.
RUNS_AS = {"copy_to_tp_region backward": "reduce_from_tp_region",
           "scatter_to_tp_region backward": "gather_from_tp_region"}
# Rank 1's tensor in each variant.
VARIANTS = {
    "rows": lambda: torch.ones(2, 8),
    "rows_not_divisible": lambda: torch.ones(3, 8),  # reduce-scatter must not fail on rank 1 alone
    "dtype": lambda: torch.ones(4, 8, dtype=torch.float64),
}
DTYPE_NAMES = {torch.float32: "Float", torch.float64: "Double"}


def _described(t: torch.Tensor) -> str:
    return f"[{', '.join(str(n) for n in t.shape)}] {DTYPE_NAMES[t.dtype]}"


def _mismatched(kinds, variants):
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    outcomes = {}
    for kind in kinds:
        for variant in variants:
            x = torch.ones(4, 8) if rank == 0 else VARIANTS[variant]()
            outcomes[kind, variant] = run_case(lambda: MISMATCHES[kind][0](group, x))
    # Found before any data moved: the group still serves a matching call.
    outcomes["after"] = run_case(lambda: O.reduce_from_tp_region(torch.ones(3), group).tolist())
    # Ranks that run different collectives on the same tensor.
    outcomes["kinds"] = run_case(lambda: (O.reduce_from_tp_region if rank == 0 else O.gather_from_tp_region)(
        torch.ones(4, 8), group))
    return outcomes


@pytest.fixture(scope="module")
def mismatched(ranks):
    per_rank = ranks(2).run(_mismatched, list(MISMATCHES), list(VARIANTS), timeout=120)
    return per_rank


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_mismatched_tensors_raise_on_every_rank(mismatched, kind, variant):
    moved = MISMATCHES[kind][1]
    ours, theirs = _described(moved(torch.ones(4, 8))), _described(moved(VARIANTS[variant]()))
    assert_outcomes([r[kind, variant] for r in mismatched], "RuntimeError",
                    [f"torchpp.{RUNS_AS.get(kind, kind)}", "passed different tensors to one collective",
                     f"{ours} on rank 0", f"{theirs} on rank 1"], within_s=WITHIN_S)


def test_group_still_works_after_a_mismatch(mismatched):
    assert_outcomes([r["after"] for r in mismatched], None, ["[2.0, 2.0, 2.0]"], within_s=WITHIN_S)


def test_different_collectives_are_named(mismatched):
    assert_outcomes([r["kinds"] for r in mismatched], "RuntimeError",
                    ["all-reduce of [4, 8] Float on rank 0", "all-gather of [4, 8] Float on rank 1"],
                    within_s=WITHIN_S)


def _different_batches_under_cp():
    import torchpp
    from torchpp.models import parallelize
    from torchpp.testing.model_checks import packed_positions
    from torchpp.testing.tiny_models import tiny_model

    state = torchpp.init_parallel(cp=2)
    model = parallelize(tiny_model("llama"), state=state)
    ids, rank = torch.zeros(2, 16, dtype=torch.long), dist.get_rank()
    return run_case(lambda: model(input_ids=ids, position_ids=packed_positions(2, 16) if rank == 0 else None))


def test_cp_ranks_given_different_batches_raise_on_every_rank(ranks):
    assert_outcomes(ranks(2).run(_different_batches_under_cp, timeout=120), "ValueError",
                    ["cp group [0, 1] were given different batches", "position ids differ"], within_s=WITHIN_S)
