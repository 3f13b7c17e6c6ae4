"""Data-parallel buckets of split-B/W weights launch after the W pass, never after I, and
reduce the gradients W delivered."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchpp.tensor_parallel as tp
from torchpp.parallel import GradReducer
from torchpp.pipeline import weight_grad_store
from tp_reference import singleton_group


def check_bucket_waits_for_w():
    world = dist.get_world_size()
    alone = singleton_group()
    torch.manual_seed(0)
    layers = [tp.ColumnParallelLinear(4, 4, group=alone, split_bw=True) for _ in range(2)]
    params = [p for layer in layers for p in layer.parameters()]
    reducer = GradReducer(params, dist.group.WORLD, bucket_bytes=1, accumulations_per_step=1)  # a bucket per tensor
    x = torch.randn(3, 4) * (dist.get_rank() + 1)

    with weight_grad_store.capture(0, 0):
        layers[1](layers[0](x)).sum().backward()
    launched = [b.work is not None for b in reducer.buckets]
    assert not any(launched), f"a bucket launched after the I pass, before W delivered: {launched}"
    weight_grad_store.run(0, 0)
    launched = [b.work is not None for b in reducer.buckets]
    assert all(launched), f"the W pass did not launch every bucket: {launched}"
    stats = reducer.finish()
    assert stats.launched_early == stats.buckets == len(params)

    # Reference: plain linears, each rank's local gradients, averaged over ranks.
    ref = [p.detach().clone().requires_grad_() for p in params]
    F.linear(F.linear(x, ref[0], ref[1]), ref[2], ref[3]).sum().backward()
    for want, param in zip(ref, params):
        grads = [torch.empty_like(want.grad) for _ in range(world)]
        dist.all_gather(grads, want.grad)
        torch.testing.assert_close(param.grad, sum(grads) / world)
    return True


def test_dp_buckets_launch_after_w(ranks):
    assert ranks(2).run(check_bucket_waits_for_w) == [True, True]
