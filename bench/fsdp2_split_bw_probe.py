"""Why torchpp's ZeRO-3 is its own and not PyTorch's FSDP2 (``fully_shard``): a measured check.

    torchrun --standalone --nproc-per-node 2 bench/fsdp2_split_bw_probe.py

Two torchpp linears, each wrapped by ``fully_shard`` over 2 gloo ranks (CPU), run one backward
as a zero-bubble schedule runs it: the I pass (input gradients) under
``weight_grad_store.capture``, then the W pass (``weight_grad_store.run``), which delivers the
deferred weight gradients. With ``--no-split`` (one backward) FSDP2's sharded gradients equal the
DP average; with the split, FSDP2's post-backward (its reduce-scatter) has run by the end of I,
and no parameter gets a sharded gradient at all (torch 2.13, measured 2026-11-25): every
schedule with W passes would lose its gradients (and the split run aborts at exit with
"terminate called without an active exception"). torchpp's ZeRO-3 counts the W pass as a
gradient's last accumulation (as its data-parallel reducer does) and reduce-scatters after it.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torchpp.tensor_parallel as tp
from torchpp.pipeline import weight_grad_store


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-split", action="store_true", help="one backward, no W pass (the control)")
    split = not parser.parse_args().no_split
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # tp=1
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[tp.ColumnParallelLinear(4, 4, group=alone, split_bw=split) for _ in range(2)])
    layers = layers.double()
    ref = [p.detach().clone().requires_grad_() for p in layers.parameters()]
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(layers, mesh=mesh["dp"])
    x = torch.randn(3, 4, dtype=torch.float64) * (rank + 1)
    with weight_grad_store.capture(0, 0):
        layers(x).sum().backward()
    weight_grad_store.run(0, 0)
    F.linear(F.linear(x, ref[0], ref[1]), ref[2], ref[3]).sum().backward()
    for (name, param), want in zip(layers.named_parameters(), ref):
        dist.all_reduce(want.grad)
        got = None if param.grad is None else param.grad.full_tensor()
        verdict = "no gradient" if got is None else f"max error {float((got - want.grad / 2).abs().max()):.3g}"
        if rank == 0:
            print(f"split_bw={split} {name}: {verdict}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
