"""torchpp.models.gpt under TP (and SP) equals the same GPT on one rank: loss and every gradient."""
import pytest
import torch
import torch.distributed as dist

import torchpp.tensor_parallel as tp
from torchpp.models.gpt import GPT, GPTConfig, gpt_loss
from tp_reference import assert_close, tp_subgroup, singleton_group



def check_gpt(tp_size, sequence_parallel, dtype):
    group, alone = tp_subgroup(tp_size), singleton_group()
    config = GPTConfig(vocab_size=32, hidden_size=16, num_heads=4, num_layers=2, max_seq_len=8)
    torch.manual_seed(5)
    tokens = torch.randint(0, 32, (2, 8))
    labels = torch.randint(0, 32, (2, 8))

    def run(tp_group, sp):
        torch.manual_seed(11)  # same full weights on every rank and in the reference
        model = GPT(config, group=tp_group, sequence_parallel=sp).to(dtype)
        loss = gpt_loss(model(tokens), labels, tp_group)
        loss.backward()
        if sp:
            tp.allreduce_sequence_parallel_grads(model, tp_group)
        return model, loss.detach()

    reference, ref_loss = run(alone, False)
    parallel, loss = run(group, sequence_parallel)
    what = f"gpt tp={tp_size} sp={sequence_parallel} {dtype}"
    assert_close(loss, ref_loss, f"{what} loss")
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    rank = dist.get_rank(group)
    for name, param in parallel.named_parameters():
        want = ref_grads[name]
        if getattr(param, "tensor_model_parallel", False):
            want = want.chunk(tp_size, param.partition_dim)[rank]
        assert_close(param.grad, want, f"{what} grad of {name}")
    return True


def check_gpt_layouts(tp_size):
    for sequence_parallel in (False, True):
        for dtype in (torch.float64, torch.float32):
            check_gpt(tp_size, sequence_parallel, dtype)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt_tensor_parallel_matches_single_rank(ranks, world_size):
    assert ranks(world_size).run(check_gpt_layouts, world_size) == [True] * world_size
