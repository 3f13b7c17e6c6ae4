"""init_parallel groups, data-parallel gradient reduction, ZeRO-1 and global-norm clipping:
3 AdamW steps on dp x tp layouts equal one process training on the full batch."""
import pytest
import torch
import torch.distributed as dist

from torchpp.models.gpt import GPT, GPTConfig, gpt_loss
from torchpp.parallel import GradReducer, ZeroRedundancyOptimizer, clip_grad_norm_, init_parallel, rank_grid
from tp_reference import assert_close, singleton_group, train_reference

CONFIG = GPTConfig(vocab_size=32, hidden_size=16, num_heads=4, num_layers=2, max_seq_len=8)
BATCH, MICROBATCHES, STEPS, MAX_NORM = 8, 2, 3, 0.5


def check_groups():
    rank = dist.get_rank()
    state = init_parallel(tp=2, pp=2)
    assert (state.tp, state.pp, state.dp) == (2, 2, 1)
    # Megatron order: TP fastest, then DP, then PP.
    assert dist.get_process_group_ranks(state.tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(state.pp_group) == [rank % 2, rank % 2 + 2]
    assert state.mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert state.mesh["tp"].get_group().group_name == state.tp_group.group_name
    assert (state.pp_rank, state.tp_rank) == (rank // 2, rank % 2)
    swapped = init_parallel(tp=2, pp=2, order="pp-tp-dp")
    assert dist.get_process_group_ranks(swapped.pp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    for kwargs, message in (
        (dict(tp=3), "world size 4 is not divisible by tp*pp = 3*1"),
        (dict(tp=2, dp=4), "tp*pp*dp = 2*1*4 = 8 does not equal the world size 4"),
        (dict(tp=4, num_heads=6), "tp=4 must divide the number of attention heads 6"),
        (dict(pp=4, num_layers=2), "pp=4 is larger than the number of layers 2"),
        (dict(tp=2, order="tp-pp"), "order 'tp-pp'"),
    ):
        with pytest.raises(ValueError, match=message.replace("*", r"\*")):
            init_parallel(**kwargs)
    return True


def test_init_parallel_groups_and_errors(ranks):
    assert ranks(4).run(check_groups) == [True] * 4


def test_rank_grid_orders():
    assert rank_grid(tp=2, pp=2, dp=2)[1, 0, 1].item() == 5  # pp=1, dp=0, tp=1 -> 4 + 0 + 1
    assert rank_grid(tp=2, pp=2, dp=2, order="pp-dp-tp")[1, 0, 1].item() == 1 + 4


def _data():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.max_seq_len), generator=g)
    labels = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.max_seq_len), generator=g)
    return tokens, labels


def _reference_losses():
    """One process, the full batch, torch's own clipping and AdamW."""
    alone = singleton_group()
    torch.manual_seed(11)
    # fp64: the key bias has an exactly-zero gradient (softmax ignores it), and Adam would turn
    # fp32 rounding noise of ~1e-9 there into full-size, order-dependent updates.
    model = GPT(CONFIG, group=alone).double()
    tokens, labels = _data()
    losses, optimizer = train_reference(model, tokens, labels, alone, STEPS, 1e-2, MAX_NORM)
    return losses, model, optimizer


def check_training(tp_size, zero):
    ref_losses, ref_model, ref_optimizer = _reference_losses()
    state = init_parallel(tp=tp_size)
    torch.manual_seed(11)
    model = GPT(CONFIG, group=state.tp_group).double()
    if zero:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, state.dp_group, lr=1e-2)
        reducer = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reducer = GradReducer(model.parameters(), state.dp_group, bucket_bytes=4096, accumulations_per_step=MICROBATCHES)
    tokens, labels = _data()
    mine = slice(state.dp_rank * BATCH // state.dp, (state.dp_rank + 1) * BATCH // state.dp)
    losses = []
    for _ in range(STEPS):
        (reducer or optimizer).zero_grad()
        step_loss = torch.zeros((), dtype=torch.float64)
        for mb_tokens, mb_labels in zip(tokens[mine].chunk(MICROBATCHES), labels[mine].chunk(MICROBATCHES)):
            loss = gpt_loss(model(mb_tokens), mb_labels, state.tp_group) / MICROBATCHES
            loss.backward()
            step_loss += loss.detach()
        if zero:
            optimizer.reduce_scatter_grads()
            clip_grad_norm_(model.parameters(), MAX_NORM, state=state, zero_optimizer=optimizer)
            optimizer.step(grads_reduced=True)
        else:
            stats = reducer.finish()
            assert stats.launched_early == stats.buckets > 1, f"no overlap: {stats}"
            clip_grad_norm_(model.parameters(), MAX_NORM, state=state)
            optimizer.step()
        dist.all_reduce(step_loss, group=state.dp_group)
        losses.append(step_loss / state.dp)
    what = f"tp={tp_size} dp={state.dp} zero={zero}"
    assert_close(torch.stack(losses), ref_losses, f"{what} losses")
    ref_params = dict(ref_model.named_parameters())
    for name, param in model.named_parameters():
        want = ref_params[name].detach()
        if getattr(param, "tensor_model_parallel", False):
            want = want.chunk(tp_size, param.partition_dim)[state.tp_rank]
        # Adam divides by sqrt(v): where a gradient nearly cancels (rare tokens), 1e-16 summation
        # differences grow to ~1e-10, so parameters get a looser bound than the losses.
        torch.testing.assert_close(param.detach(), want, rtol=1e-6, atol=1e-8, msg=lambda m: f"{what} {name}: {m}")
    if zero:
        ref_bytes = sum(v.numel() * v.element_size() for s in ref_optimizer.state.values() for v in s.values() if v.dim())
        # Each DP rank keeps ~1/dp of the (TP-sharded) Adam state.
        per_rank_full = sum(p.numel() for p in model.parameters()) * 2 * 8
        # (Adam's per-tensor step counters and the shard padding are the few percent on top.)
        assert optimizer.state_bytes() <= 1.05 * per_rank_full / state.dp, (optimizer.state_bytes(), per_rank_full)
        assert ref_bytes >= per_rank_full
    return True


@pytest.mark.parametrize("world_size,tp_size", [(2, 1), (4, 2)])
@pytest.mark.parametrize("zero", [False, True])
def test_data_parallel_equals_full_batch(ranks, world_size, tp_size, zero):
    assert ranks(world_size).run(check_training, tp_size, zero) == [True] * world_size
