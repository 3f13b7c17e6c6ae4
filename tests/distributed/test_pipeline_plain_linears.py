"""Stages built from plain torch layers (an nn.Linear MLP, a stack of nn.TransformerEncoderLayer)
under zero-bubble schedules: their linears and attention projections run the split B/W op, so
every weight gradient arrives in a W pass (none in I), and losses and gradients equal one
process's. Controls: ``split_bw=False`` under zb-h1 puts the whole backward in I, and 1f1b leaves
the layers as they are (full backward in B)."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline_checks import TOLERANCES, config_results, local_last_microbatches, run_configs
from torchpp import _C
from torchpp import schedule as S
from torchpp.pipeline import PipelineStage, build_schedule
from torchpp.pipeline.microbatch import loss_weights, split_microbatches
from torchpp.pipeline.trace import parse_action

IN, WIDTH, OUT, HEADS, SEQ, BATCH, M = 4, 8, 3, 2, 5, 16, 8


def make_stages(model: str, num_stages: int, dtype) -> list:
    """Every model stage of ``model`` (same seed on every rank and in the reference)."""
    torch.manual_seed(0)
    stages = []
    for k in range(num_stages):
        if model == "mlp":
            layers = [nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH, bias=k % 2 == 0)]
        else:
            layers = [nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, batch_first=True,
                                                 norm_first=k % 2 == 1)]
        if k == 0:
            layers.insert(0, nn.Linear(IN, WIDTH))
        if k == num_stages - 1:
            layers.append(nn.Linear(WIDTH, OUT))
        stages.append(nn.Sequential(*layers).to(dtype))
    return stages


def _record(arrivals, seen, name, param) -> None:
    # A deferred parameter's hook also fires in I, with its .grad unchanged (nothing arrived):
    # only a changed gradient counts as an arrival.
    if param.grad is None or (name in seen and torch.equal(seen[name], param.grad)):
        return
    seen[name] = param.grad.clone()
    arrivals.append((name, "W" if _C.wgrad_in_deferred_accumulate() else "I" if _C.wgrad_capturing() else "B"))


def _is_split_param(name: str) -> bool:
    """Parameters of a linear or an attention projection (every one a leaf of a deferrable op)."""
    return "norm" not in name


def _check(name, model, pp_group, dtype=torch.float64, split_bw=None, steps=2):
    rank = dist.get_rank(pp_group)
    probe = S.generate(name, num_ranks=dist.get_world_size(pp_group), num_microbatches=M)
    num_stages = probe.num_stages // probe.num_pipelines
    modules, reference = make_stages(model, num_stages, dtype), make_stages(model, num_stages, dtype)
    mine = sorted({probe.model_stage(s) for s, r in enumerate(probe.stage_to_rank) if r == rank})
    stages = [PipelineStage(modules[k], k, num_stages, "cpu", group=pp_group, split_bw=split_bw) for k in mine]
    sched = build_schedule(name, stages, M, loss_fn=F.mse_loss)
    # Who delivered each gradient: W (the store's deferred accumulate), I (a capture), or B.
    arrivals, seen = [], {}
    for k in mine:
        for pname, param in modules[k].named_parameters():
            param.register_post_accumulate_grad_hook(functools.partial(_record, arrivals, seen, f"{k}.{pname}"))
    params = [p for k in mine for p in modules[k].parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    ref_opt = torch.optim.SGD([p for m in reference for p in m.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(1)
    shares, ref_losses = [], []
    for step in range(steps):
        x = torch.randn(BATCH, SEQ, IN, generator=g, dtype=dtype)
        y = torch.randn(BATCH, SEQ, OUT, generator=g, dtype=dtype)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        arrivals.clear()
        seen.clear()
        losses = []
        sched.step(x, target=y, losses=losses)
        out = x
        for module in reference:
            out = module(out)
        ref_loss = F.mse_loss(out, y)
        ref_loss.backward()
        weights = loss_weights(split_microbatches(y, M))
        shares.append(sum(weights[k] * loss.item() for k, loss in zip(local_last_microbatches(sched), losses)))
        ref_losses.append(ref_loss.item())
        for k in mine:
            for (pname, got), want in zip(modules[k].named_parameters(), reference[k].parameters()):
                torch.testing.assert_close(got.grad, want.grad, **TOLERANCES[dtype],
                                           msg=lambda s, n=f"{k}.{pname}": f"{name} step {step} grad of {n}: {s}")
        opt.step()
        ref_opt.step()
    kinds = {}  # per model stage: how many of its backward passes of each kind ran on this rank
    for stage, kind, _ in map(parse_action, probe.actions(rank)):
        if kind in ("I", "W", "B"):
            counts = kinds.setdefault(probe.model_stage(stage), {"I": 0, "W": 0, "B": 0})
            counts[kind] += 1
    by_param = {}
    for pname, via in arrivals:  # the last step's
        by_param.setdefault(pname, {"I": 0, "W": 0, "B": 0})[via] += 1
    return {
        "shares": shares, "ref_losses": ref_losses, "kinds": kinds, "arrivals": by_param,
        "split_modules": {k: st.split_bw_modules for k, st in zip(mine, stages)},
        "classes": {k: sorted({type(m).__name__ for m in modules[k].modules()}) for k in mine},
        "timeline_w": sum(1 for a, *_ in sched.timeline() if parse_action(a)[1] == "W"),
    }


# (schedule, model, options, expectation): "W" every linear gradient in W; "I" whole backward
# in I (flag off); "B" full backward, layers untouched.
CONFIGS = [
    ("zb-h1", "mlp", {}, "W"),
    ("zb-h1", "encoder", {}, "W"),
    ("zb-h1", "encoder", dict(dtype=torch.float32), "W"),
    ("zb-v", "mlp", {}, "W"),
    ("zb-v", "encoder", {}, "W"),
    ("dualpipe-v", "encoder", {}, "W"),
    ("interleaved-zb", "encoder", {}, "W"),
    ("zb-h1", "encoder", dict(split_bw=False), "I"),
    ("1f1b", "encoder", {}, "B"),
    ("1f1b", "mlp", dict(split_bw=True), "B"),  # forced on: swapped, but B is a full backward
]


def _label(config):
    name, model, options, _ = config
    return "-".join([name, model] + [f"{k}={v}".replace("torch.", "") for k, v in options.items()])


@pytest.fixture(scope="module")
def results(ranks):
    configs = [dict(name=n, model=m, **o) for n, m, o, _ in CONFIGS]
    return ranks(2).run(run_configs, configs, _check, timeout=300)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[_label(c) for c in CONFIGS])
def test_plain_layers_split_under_zero_bubble(results, index):
    name, model, options, expect = CONFIGS[index]
    per_rank = config_results(results, index)
    rtol = TOLERANCES[options.get("dtype", torch.float64)]["rtol"]
    for step, ref in enumerate(per_rank[0]["ref_losses"]):
        assert sum(r["shares"][step] for r in per_rank) == pytest.approx(ref, rel=rtol)
    forced = options.get("split_bw")
    for rank, result in enumerate(per_rank):
        for stage, counts in result["kinds"].items():
            names = [n for n in result["arrivals"] if n.startswith(f"{stage}.")]
            assert names, (rank, stage)
            if expect == "W":
                assert counts["W"] > 0 and result["timeline_w"] > 0
            for pname in names:
                got = result["arrivals"][pname]
                if not _is_split_param(pname.split(".", 1)[1]):  # LayerNorm: whole backward in I or B
                    assert got == {"I": counts["I"], "W": 0, "B": counts["B"]}, (rank, pname, got)
                elif expect == "W":  # the weight gradient waits for W, every time
                    assert got == {"I": 0, "W": counts["W"], "B": counts["B"]}, (rank, pname, got, counts)
                elif expect == "I":
                    assert got == {"I": counts["I"], "W": 0, "B": 0}, (rank, pname, got)
                else:
                    assert got == {"I": 0, "W": 0, "B": counts["B"]} and counts["B"] == M, (rank, pname, got)
        swapped = [n for names in result["split_modules"].values() for n in names]
        classes = {c for cs in result["classes"].values() for c in cs}
        if expect == "W" or forced:
            assert swapped and "Linear" not in classes and any(c.startswith("SplitBW") for c in classes), classes
            if model == "encoder":
                assert any(n.endswith("self_attn") for n in swapped) and any(n.endswith("out_proj") for n in swapped)
        else:  # flag off, or a schedule without W: torch's own classes
            assert not swapped and not any(c.startswith("SplitBW") for c in classes), classes
