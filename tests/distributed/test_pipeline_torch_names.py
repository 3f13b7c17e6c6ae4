"""Migration by changing imports: the same program, written against
torch.distributed.pipelining's PipelineStage and schedule classes, runs with torchpp's classes
of the same names, and both give the same losses and gradients (and those of one process)."""
from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining as torch_pp
import torch.nn.functional as F
from torch import nn

import torchpp.pipeline as torchpp_pp
from pipeline_checks import config_results, run_configs

FEATURES, BATCH, M = 6, 16, 8
TOL = dict(rtol=1e-10, atol=1e-12)
# class name -> (model stages per rank, the model stages rank r of p holds)
CLASSES = {
    "ScheduleGPipe": (1, lambda r, p: [r]),
    "Schedule1F1B": (1, lambda r, p: [r]),
    "ScheduleInterleaved1F1B": (2, lambda r, p: [r, r + p]),
    "ScheduleInterleavedZeroBubble": (2, lambda r, p: [r, r + p]),
    "ScheduleLoopedBFS": (2, lambda r, p: [r, r + p]),
    "ScheduleZBVZeroBubble": (2, lambda r, p: [r, 2 * p - 1 - r]),
    "ScheduleDualPipeV": (2, lambda r, p: [r, 2 * p - 1 - r]),
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def user_program(pp, class_name, blocks, group, x, y):
    """What a user writes; `pp` is the module it imports from. Returns its stages and losses."""
    per_rank, place = CLASSES[class_name]
    rank, p = dist.get_rank(group), group.size()
    count, mine = per_rank * p, place(rank, p)
    stages = [pp.PipelineStage(blocks[k], k, count, torch.device("cpu"), group=group) for k in mine]
    sched = getattr(pp, class_name)(stages[0] if per_rank == 1 else stages, M, loss_fn=F.mse_loss)
    losses = []
    sched.step(*([x] if 0 in mine else []), target=y if count - 1 in mine else None, losses=losses)
    return mine, losses


class HeldLinear(torch.autograd.Function):
    """x @ w.T whose backward returns the input gradient only and queues the weight gradient for
    the stage's dw_builder runner: the pattern torch's ``dw_builder`` serves."""

    @staticmethod
    def forward(ctx, x, weight, queue):
        ctx.save_for_backward(x, weight)
        ctx.queue = queue
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors

        def weight_grad():
            g = grad.t() @ x
            weight.grad = g if weight.grad is None else weight.grad + g

        ctx.queue.append(weight_grad)
        EVENTS.append(("I", id(ctx.queue)))
        return grad @ weight, None, None


# This rank's backwards ("I") and runners ("W") in order, each with its block's id.
EVENTS = []


class HeldBlock(nn.Module):
    """A block whose weight gradient arrives only through its stage's dw_builder runner."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(FEATURES, FEATURES) / FEATURES)
        self.queue = []

    def forward(self, x):
        return x + torch.tanh(HeldLinear.apply(x, self.weight, self.queue))

    def dw_builder(self):
        """torch's contract: called after a backward; the runner it returns completes it."""
        pending = list(self.queue)
        self.queue.clear()

        def runner():
            EVENTS.append(("W", id(self.queue)))
            for work in pending:
                work()

        return runner


def scaled_mse(output, target, scale=1.0):
    return scale * F.mse_loss(output, target)


# The arguments of torch 2.13's API beyond the basics: example args in their positions,
# dw_builder and loss_kwargs.
FULL_API = ["Schedule1F1B", "ScheduleZBVZeroBubble"]
LOSS_KWARGS = {"scale": 0.75}


# torch 2.13 added PipelineStage's gradient examples (output_grads, input_grads) before group.
GRADIENT_EXAMPLES = "output_grads" in inspect.signature(torch_pp.PipelineStage.__init__).parameters
# torch 2.11's own V-shaped schedules fail over gloo at their stages' first exchange, where a rank
# holds two adjacent stages ("Pair is not connected" in batch_isend_irecv); torchpp's run there is
# checked against one process only.
# torch 2.11's step has no loss_kwargs (it hands them to the model): its loss_fn gets them bound.
TORCH_LOSS_KWARGS = "loss_kwargs" in inspect.signature(torch_pp.Schedule1F1B.step).parameters
TORCH_PEER_FAILS = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"} if torch.__version__ < "2.13" else set()


def full_api_program(pp, class_name, blocks, group, x, y):
    per_rank, place = CLASSES[class_name]
    rank, p = dist.get_rank(group), group.size()
    count, mine = per_rank * p, place(rank, p)
    example = torch.empty(BATCH // M, FEATURES, dtype=torch.float64)
    received = example.clone().requires_grad_()  # torch reads requires_grad from input examples
    # Every example, in the installed torch's positions (torchpp takes 2.11's and 2.13's); no
    # gradient reaches the last stage's output or leaves the first stage's input.
    grads = lambda k: (None if k == count - 1 else example, None if k == 0 else example)  # noqa: E731
    stages = [pp.PipelineStage(blocks[k], k, count, torch.device("cpu"), example if k == 0 else received, example,
                               *(grads(k) if GRADIENT_EXAMPLES else ()), group, blocks[k].dw_builder) for k in mine]
    if pp is torch_pp and not TORCH_LOSS_KWARGS:  # the same loss, the scale bound in
        loss_fn, loss_kwargs = functools.partial(scaled_mse, **LOSS_KWARGS), {}
    else:
        loss_fn, loss_kwargs = scaled_mse, dict(loss_kwargs=LOSS_KWARGS)
    sched = getattr(pp, class_name)(stages[0] if per_rank == 1 else stages, M, loss_fn)
    losses = []
    sched.step(*([x] if 0 in mine else []), target=y if count - 1 in mine else None, losses=losses, **loss_kwargs)
    return mine, losses


def _assert_same_as_torch_and_one_process(mine, our_losses, torch_losses, ours, theirs, reference):
    """This rank's losses equal torch's; its blocks' gradients equal torch's and one process's
    (one process's only where torch_losses is None: TORCH_PEER_FAILS)."""
    if torch_losses is not None:
        assert len(our_losses) == len(torch_losses)
        for a, b in zip(our_losses, torch_losses):
            torch.testing.assert_close(a, b, **TOL)
    for k in mine:
        for (name, want), got, torch_got in zip(reference[k].named_parameters(), ours[k].parameters(),
                                                theirs[k].parameters()):
            torch.testing.assert_close(got.grad, want.grad, **TOL, msg=lambda m, n=name: f"{k}.{n} vs 1 process: {m}")
            if torch_losses is not None:
                torch.testing.assert_close(got.grad, torch_got.grad, **TOL,
                                           msg=lambda m, n=name: f"{k}.{n} vs torch: {m}")


def _check(class_name, pp_group, full_api=False):
    torch.manual_seed(0)
    blocks = [(HeldBlock if full_api else Block)().double() for _ in range(CLASSES[class_name][0] * pp_group.size())]
    theirs, ours, reference = copy.deepcopy(blocks), copy.deepcopy(blocks), nn.Sequential(*copy.deepcopy(blocks))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    program = full_api_program if full_api else user_program
    EVENTS.clear()
    mine, torch_losses = (None, None) if class_name in TORCH_PEER_FAILS else program(torch_pp, class_name, theirs,
                                                                                      pp_group, x, y)
    torch_events = EVENTS[:]
    EVENTS.clear()
    mine, our_losses = program(torchpp_pp, class_name, ours, pp_group, x, y)
    our_events = EVENTS[:]
    if full_api:
        scaled_mse(reference(x), y, **LOSS_KWARGS).backward()
        for block in reference:
            block.dw_builder()()
        # A runner per microbatch and stage. torchpp runs it at once after a full backward (1F1B)
        # and at the microbatch's W under zero bubble, other backwards coming in between (torch
        # 2.13 runs ZB-V's at once too).
        for events in (our_events, torch_events) if torch_losses is not None else (our_events,):
            kinds = "".join(kind for kind, _ in events)
            assert kinds.count("I") == kinds.count("W") == M * len(mine), kinds
        at_once = all(our_events[i + 1] == ("W", block) for i, (kind, block) in enumerate(our_events) if kind == "I")
        assert at_once == (class_name == "Schedule1F1B"), our_events
    else:
        F.mse_loss(reference(x), y).backward()
    _assert_same_as_torch_and_one_process(mine, our_losses, torch_losses, ours, theirs, reference)
    return len(our_losses)


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(run_configs, [dict(class_name=n) for n in CLASSES], _check, timeout=180)


@pytest.mark.parametrize("index", range(len(CLASSES)), ids=list(CLASSES))
def test_torch_program_runs_unchanged_with_torchpp_imports(results, index):
    per_rank = config_results(results, index)
    assert sum(per_rank) == M  # every microbatch's loss came back, on the ranks holding last stages


@pytest.fixture(scope="module")
def full_api_results(ranks):
    return ranks(2).run(run_configs, [dict(class_name=n, full_api=True) for n in FULL_API], _check, timeout=180)


@pytest.mark.parametrize("index", range(len(FULL_API)), ids=FULL_API)
def test_example_args_dw_builder_and_loss_kwargs_as_in_torch(full_api_results, index):
    per_rank = config_results(full_api_results, index)
    assert sum(per_rank) == M


class SeqBlock(nn.Module):
    """A block on sequence-first activations [S, B, F]; the first stage also takes a replicated
    gate and a mask [S, B]."""

    def __init__(self, first: bool):
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)
        self.first = first

    def forward(self, x, gate=None, *, mask=None):
        if gate is not None:
            x = x * gate
        # torch's multi-stage schedules pass step()'s kwargs to every stage of the rank, torchpp
        # to the first stage only: only the first block reads them.
        if mask is not None and self.first:
            x = x * mask[..., None]
        return x + torch.tanh(self.fc(x))


SEQ = 5
# Schedules the chunk-spec program runs under: one stage and two stages per rank.
CHUNKED = ["Schedule1F1B", "ScheduleInterleaved1F1B"]


def seq_first_mse(output, target):
    # Transposing the target keeps the output's gradient contiguous, which torch's gloo receives need.
    return F.mse_loss(output, target.transpose(0, 1))


def chunk_spec_program(pp, class_name, blocks, group, x, y, gate, mask):
    """A sequence-first model: the batch and the mask split along dim 1, the gate goes whole to
    every microbatch, the outputs merge along dim 1; the target splits along dim 0 (torch's
    rule)."""
    per_rank, place = CLASSES[class_name]
    rank, p = dist.get_rank(group), group.size()
    count, mine = per_rank * p, place(rank, p)
    stages = [pp.PipelineStage(blocks[k], k, count, torch.device("cpu"), group=group) for k in mine]
    mb = pp.microbatch
    sched = getattr(pp, class_name)(stages[0] if per_rank == 1 else stages, M, seq_first_mse,
                                    args_chunk_spec=(mb.TensorChunkSpec(1), mb._Replicate()),
                                    kwargs_chunk_spec=mb.TensorChunkSpec.from_dict({"mask": 1}),
                                    output_merge_spec=mb.TensorChunkSpec(1))
    losses = []
    first = dict(mask=mask) if 0 in mine else {}
    output = sched.step(*([x, gate] if 0 in mine else []), target=y if count - 1 in mine else None,
                        losses=losses, **first)
    return mine, losses, output


def _check_chunk_specs(class_name, pp_group):
    torch.manual_seed(0)
    blocks = [SeqBlock(k == 0).double() for k in range(CLASSES[class_name][0] * pp_group.size())]
    theirs, ours, reference = copy.deepcopy(blocks), copy.deepcopy(blocks), copy.deepcopy(blocks)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, SEQ, FEATURES, generator=g, dtype=torch.float64)
    gate = torch.rand(SEQ, 1, FEATURES, generator=g, dtype=torch.float64)
    mask = (torch.rand(SEQ, BATCH, generator=g) > 0.3).double()
    mine, torch_losses, torch_out = chunk_spec_program(torch_pp, class_name, theirs, pp_group, x, y, gate, mask)
    _, our_losses, our_out = chunk_spec_program(torchpp_pp, class_name, ours, pp_group, x, y, gate, mask)
    want = reference[0](x, gate, mask=mask)
    for block in reference[1:]:
        want = block(want)
    seq_first_mse(want, y).backward()
    if len(blocks) - 1 in mine:
        assert our_out.shape == (SEQ, BATCH, FEATURES)
        torch.testing.assert_close(our_out, want.detach(), **TOL)
        torch.testing.assert_close(our_out, torch_out, **TOL)
        torch.testing.assert_close(sum(our_losses) / M, seq_first_mse(want, y).detach(), **TOL)
    _assert_same_as_torch_and_one_process(mine, our_losses, torch_losses, ours, theirs, reference)
    return len(our_losses)


@pytest.fixture(scope="module")
def chunk_spec_results(ranks):
    return ranks(2).run(run_configs, [dict(class_name=n) for n in CHUNKED], _check_chunk_specs, timeout=180)


@pytest.mark.parametrize("index", range(len(CHUNKED)), ids=CHUNKED)
def test_chunk_specs_split_and_merge_as_in_torch(chunk_spec_results, index):
    per_rank = config_results(chunk_spec_results, index)
    assert sum(per_rank) == M


def test_get_schedule_class_and_bases_as_in_torch():
    from torch.distributed.pipelining import schedules as torch_schedules

    from torchpp.pipeline import schedules as torchpp_schedules

    for name in ["1F1B", "interleaved1f1b", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                 "DualPipeV", "PipelineScheduleSingle", "PipelineScheduleMulti"]:
        assert torchpp_schedules.get_schedule_class(name).__name__ == torch_schedules.get_schedule_class(name).__name__
        assert getattr(torchpp_schedules, torch_schedules.get_schedule_class(name).__name__) is \
            torchpp_pp.get_schedule_class(name)
    for name in CLASSES:
        single = issubclass(getattr(torch_pp, name), torch_schedules.PipelineScheduleSingle)
        assert issubclass(getattr(torchpp_pp, name), torchpp_pp.PipelineScheduleSingle) == single
        assert issubclass(getattr(torchpp_pp, name), torchpp_pp.PipelineScheduleMulti) == (not single)
    with pytest.raises(ValueError, match="unknown schedule name 'zb-h1'"):
        torchpp_pp.get_schedule_class("zb-h1")
    with pytest.raises(TypeError, match="PipelineScheduleSingle is an abstract base"):
        torchpp_pp.PipelineScheduleSingle(None, M)


@pytest.mark.parametrize("name", ["PipelineStage", "PipelineScheduleSingle"] + list(CLASSES))
def test_torch_parameters_in_torch_order(name):
    """Every parameter of torch's constructor, in the same position, so that positional calls
    migrate too; torchpp's own options come after them."""
    torch_class = getattr(torch_pp, name, None) or getattr(torch_pp.schedules, name)  # 2.11: no stage in schedules
    theirs = list(inspect.signature(torch_class.__init__).parameters)
    ours = list(inspect.signature(getattr(torchpp_pp.schedules, name).__init__).parameters)
    if name == "PipelineStage" and not GRADIENT_EXAMPLES:  # torch 2.11/2.12: the call without them (stage.py)
        ours = [p for p in ours if p not in ("output_grads", "input_grads")]
    assert ours[: len(theirs)] == theirs


@pytest.mark.parametrize("method", ["step", "eval"])
def test_schedule_call_takes_torch_keywords(method):
    theirs = inspect.signature(getattr(torch_pp.Schedule1F1B, method)).parameters
    ours = inspect.signature(getattr(torchpp_pp.PipelineSchedule, method)).parameters
    assert set(theirs) <= set(ours)


def test_stage_arguments_torchpp_cannot_honour_are_named():
    example = torch.empty(2, FEATURES)
    make = torchpp_pp.PipelineStage
    with pytest.raises(ValueError, match="get_mesh=.*DTensor"):
        make(Block(), 0, 2, "cpu", get_mesh=lambda *a: None)
    with pytest.raises(ValueError, match=r"input_grads\[0\] is \[2, 3\] torch.float32 but input_args\[0\] is \[2, 6\]"):
        make(Block(), 0, 2, "cpu", example, input_grads=torch.empty(2, 3))
    with pytest.raises(ValueError, match="output_grads has 2 entries but output_args has 1"):
        make(Block(), 0, 2, "cpu", output_args=example, output_grads=(example, None))
    with pytest.raises(TypeError, match="output_args must be a tensor or a tuple of tensors, got 'x'"):
        make(Block(), 0, 2, "cpu", output_args="x")
    with pytest.raises(ValueError, match="backward_requires_autograd=False"):
        torchpp_pp.ScheduleZBVZeroBubble([], M, backward_requires_autograd=False)


def check_positional_group_of_older_torch():
    group, block = dist.group.WORLD, HeldBlock().double()
    rank = dist.get_rank()
    stage = torchpp_pp.PipelineStage(block, rank, 2, torch.device("cpu"), None, None, group, block.dw_builder)
    assert stage.group is group and stage.dw_builder == block.dw_builder
    with pytest.raises(TypeError, match="torch 2.11's positional group"):
        torchpp_pp.PipelineStage(block, rank, 2, torch.device("cpu"), None, None, group, group=group)
    return True


def test_positional_group_as_torch_2_11_places_it(ranks):
    """torch 2.11 and 2.12 take (..., output_args, group, dw_builder): such a call migrates too."""
    assert ranks(2).run(check_positional_group_of_older_torch) == [True, True]
