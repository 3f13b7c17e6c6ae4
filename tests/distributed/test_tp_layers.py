"""Megatron MLP and attention blocks, vocab-parallel embedding and cross entropy, and the RNG
tracker, on real gloo ranks: outputs and every parameter gradient equal the unsharded model."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchpp.tensor_parallel as tp
from tp_reference import MLP, Attention, assert_close, attention_core, tp_subgroup

SEQ, BATCH, HIDDEN, HEADS, VOCAB = 8, 2, 16, 4, 32


class ParallelMLP(nn.Module):
    def __init__(self, ref: MLP, group, sequence_parallel):
        super().__init__()
        self.norm = tp.mark_sequence_parallel(ref.norm) if sequence_parallel else ref.norm
        self.fc1 = tp.ColumnParallelLinear.from_linear(ref.fc1, group=group, sequence_parallel=sequence_parallel)
        self.fc2 = tp.RowParallelLinear.from_linear(
            ref.fc2, group=group, input_is_parallel=True, sequence_parallel=sequence_parallel
        )

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class ParallelAttention(nn.Module):
    def __init__(self, ref: Attention, group, sequence_parallel):
        super().__init__()
        self.heads_per_rank = tp.divide(ref.heads, group.size(), "heads")
        self.norm = tp.mark_sequence_parallel(ref.norm) if sequence_parallel else ref.norm
        column = dict(group=group, sequence_parallel=sequence_parallel)
        self.q = tp.ColumnParallelLinear.from_linear(ref.q, **column)
        self.k = tp.ColumnParallelLinear.from_linear(ref.k, **column)
        self.v = tp.ColumnParallelLinear.from_linear(ref.v, **column)
        self.o = tp.RowParallelLinear.from_linear(ref.o, group=group, input_is_parallel=True, sequence_parallel=sequence_parallel)

    def forward(self, x):
        # Under SP the norm sees this rank's sequence slice and q/k/v all-gather the sequence.
        return self.o(attention_core(self.q, self.k, self.v, self.norm(x), self.heads_per_rank))


def _shard_of(full_grad, param, group):
    dim = getattr(param, "partition_dim", None)
    if dim is None:
        return full_grad
    return full_grad.chunk(group.size(), dim)[dist.get_rank(group)]


def check_block(kind, tp_size, sequence_parallel, dtype):
    group = tp_subgroup(tp_size)
    torch.manual_seed(0)
    ref = MLP(HIDDEN, dtype) if kind == "mlp" else Attention(HIDDEN, HEADS, dtype)
    with torch.no_grad():  # non-trivial norm parameters, so their gradients are checked for real
        ref.norm.weight.uniform_(0.5, 1.5)
        ref.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype)
    grad_out = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype)

    ref_x = x.clone().requires_grad_()
    ref_out = ref(ref_x)
    ref_out.backward(grad_out)

    import copy

    par_ref = copy.deepcopy(ref)
    par_ref.zero_grad()
    parallel = (ParallelMLP if kind == "mlp" else ParallelAttention)(par_ref, group, sequence_parallel)
    rank = dist.get_rank(group)
    local = (lambda t: t.chunk(tp_size, 0)[rank]) if sequence_parallel else (lambda t: t)
    par_x = local(x).clone().requires_grad_()
    out = parallel(par_x)
    out.backward(local(grad_out))
    if sequence_parallel:
        tp.allreduce_sequence_parallel_grads(parallel, group)

    what = f"{kind} tp={tp_size} sp={sequence_parallel} {dtype}"
    assert_close(out, local(ref_out.detach()), f"{what} output")
    assert_close(par_x.grad, local(ref_x.grad), f"{what} input grad")
    ref_params = dict(ref.named_parameters())
    for name, param in parallel.named_parameters():
        assert param.grad is not None, f"{what}: {name} got no gradient"
        assert_close(param.grad, _shard_of(ref_params[name].grad, param, group), f"{what} grad of {name}")
    return True


def check_all_blocks(tp_size):
    for kind in ("mlp", "attention"):
        for sequence_parallel in (False, True):
            for dtype in (torch.float64, torch.float32):
                check_block(kind, tp_size, sequence_parallel, dtype)
    return True


@pytest.mark.parametrize("world_size,tp_size", [(2, 2), (4, 2), (4, 4)])
def test_blocks_match_reference(ranks, world_size, tp_size):
    assert ranks(world_size).run(check_all_blocks, tp_size) == [True] * world_size


def check_vocab_parallel(tp_size, dtype, sequence_parallel):
    group = tp_subgroup(tp_size)
    rank = dist.get_rank(group)
    torch.manual_seed(1)
    embedding = nn.Embedding(VOCAB, HIDDEN, padding_idx=3, dtype=dtype)
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype)
    tokens = torch.randint(0, VOCAB, (SEQ, BATCH))
    target = torch.randint(0, VOCAB, (SEQ, BATCH))
    target[0, 0] = target[3, 1] = -100  # ignored positions

    hidden = embedding(tokens)
    ref_loss = F.cross_entropy(head(hidden).reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)
    ref_loss.backward()

    par_embedding = tp.VocabParallelEmbedding.from_embedding(embedding, group=group, sequence_parallel=sequence_parallel)
    par_head = tp.ColumnParallelLinear.from_linear(head, group=group, sequence_parallel=sequence_parallel)
    par_hidden = par_embedding(tokens)
    if sequence_parallel:
        assert par_hidden.shape[0] == SEQ // tp_size
    logits = par_head(par_hidden)
    assert logits.shape == (SEQ, BATCH, VOCAB // tp_size)
    loss = tp.vocab_parallel_cross_entropy(logits, target, group, reduction="mean")
    loss.backward()

    what = f"vocab tp={tp_size} sp={sequence_parallel} {dtype}"
    assert_close(loss.detach(), ref_loss.detach(), f"{what} loss")
    assert_close(par_embedding.weight.grad, embedding.weight.grad.chunk(tp_size)[rank], f"{what} embedding grad")
    assert_close(par_head.weight.grad, head.weight.grad.chunk(tp_size)[rank], f"{what} head grad")

    # Per-token losses and the logits' gradient, against F.cross_entropy on the gathered logits.
    full_logits = torch.randn(SEQ, BATCH, VOCAB, dtype=dtype) * 4
    ref_logits = full_logits.clone().requires_grad_()
    ref_tokens = F.cross_entropy(ref_logits.permute(0, 2, 1), target, reduction="none", ignore_index=-100)
    ref_tokens.backward(torch.ones_like(ref_tokens) * 0.5)
    shard = full_logits.chunk(tp_size, -1)[rank].clone().requires_grad_()
    tokens_loss = tp.vocab_parallel_cross_entropy(shard, target, group)
    tokens_loss.backward(torch.ones_like(tokens_loss) * 0.5)
    assert_close(tokens_loss.detach(), ref_tokens.detach(), f"{what} per-token loss")
    assert_close(shard.grad, ref_logits.grad.chunk(tp_size, -1)[rank], f"{what} logits grad")
    return True


def check_all_vocab(tp_size):
    for dtype in (torch.float64, torch.float32):
        for sequence_parallel in (False, True):
            check_vocab_parallel(tp_size, dtype, sequence_parallel)
    return True


@pytest.mark.parametrize("world_size,tp_size", [(2, 2), (4, 4)])
def test_vocab_parallel_embedding_and_cross_entropy(ranks, world_size, tp_size):
    assert ranks(world_size).run(check_all_vocab, tp_size) == [True] * world_size


def check_rng_streams():
    """TP=2 groups {0,1}, {2,3}; ranks 0 and 2 are data-parallel replicas of each other."""
    rank = dist.get_rank()
    tp_rank = rank % 2
    tp.model_parallel_manual_seed(1234, tp_rank=tp_rank)
    tracker = tp.get_rng_tracker()
    with tracker.fork():
        tp_mask = F.dropout(torch.ones(64), p=0.5)
    default_mask = F.dropout(torch.ones(64), p=0.5)
    with tracker.fork():  # the stream continues, it does not restart
        tp_mask_again = F.dropout(torch.ones(64), p=0.5)
    masks = [torch.empty(64) for _ in range(4)]
    dist.all_gather(masks, tp_mask)
    defaults = [torch.empty(64) for _ in range(4)]
    dist.all_gather(defaults, default_mask)
    assert not torch.equal(masks[0], masks[1]), "TP ranks share a dropout mask inside a TP region"
    assert torch.equal(masks[0], masks[2]) and torch.equal(masks[1], masks[3]), "DP replicas differ"
    assert all(torch.equal(defaults[0], d) for d in defaults), "default stream differs across ranks"
    assert not torch.equal(tp_mask, tp_mask_again)
    return True


def test_rng_tracker_streams(ranks):
    assert ranks(4).run(check_rng_streams) == [True] * 4
