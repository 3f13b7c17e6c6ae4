"""A schedule of one's own, in torch.distributed.pipelining's CSV format: build_schedule runs
it as given (its compute actions in its order, lowered by torchpp), with losses and gradients
equal to the single-process reference; a schedule that does not fit the group or the step is
rejected by name."""
import math

import pytest
import torch
import torch.distributed as dist

from pipeline_checks import config_results, run_configs
from torchpp import schedule as S
from torchpp.pipeline import PipelineStage, build_schedule

M = 4
CUSTOM = {
    # Every forward, then the input gradients newest first, the weight gradients last.
    "split-gpipe-lifo.csv": "0F0,0F1,0F2,0F3,0I3,0I2,0I1,0I0,0W0,0W1,0W2,0W3\n"
                            "1F0,1F1,1F2,1F3,1I3,1I2,1I1,1I0,1W3,1W2,1W1,1W0\n",
    # zb-h1 with its SEND/RECV actions, as torch writes a lowered schedule: torchpp re-lowers it.
    "zb-h1-lowered.csv": None,
    # Two stages per rank (0, 2 on rank 0; 1, 3 on rank 1) with full backwards.
    "interleaved.csv": None,
}


@pytest.fixture(scope="module")
def csv_paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("schedules")
    paths = {}
    for name, text in CUSTOM.items():
        paths[name] = str(folder / name)
        if name == "zb-h1-lowered.csv":
            S.generate("zb-h1", num_ranks=2, num_microbatches=M).lowered().to_csv(paths[name])
        elif name == "interleaved.csv":
            S.generate("interleaved-1f1b", num_ranks=2, num_microbatches=M, num_chunks=2).to_csv(paths[name])
        else:
            with open(paths[name], "w") as f:
                f.write(text)
    return paths


@pytest.fixture(scope="module")
def results(ranks, csv_paths):
    configs = [dict(name=csv_paths[name], m=M) for name in CUSTOM]
    return ranks(2).run(run_configs, configs, timeout=180)


@pytest.mark.parametrize("index", range(len(CUSTOM)), ids=list(CUSTOM))
def test_schedule_from_csv_matches_reference(results, index):
    per_rank = config_results(results, index)
    for step in range(len(per_rank[0]["steps"])):
        total = sum(r["steps"][step]["loss_share"] for r in per_rank)
        assert math.isclose(total, per_rank[0]["steps"][step]["ref_loss"], rel_tol=1e-10)
    for rank, r in enumerate(per_rank):
        assert r["peak"] == r["simulated_peak"], (rank, r["peak"], r["simulated_peak"])


def test_schedule_runs_in_its_own_order(results, csv_paths):
    """The executor's compute order on each rank is the CSV's."""
    index = list(CUSTOM).index("split-gpipe-lifo.csv")
    for rank, r in enumerate(results):
        ran = [a for a in r[index]["timeline"] if "SEND" not in a and "RECV" not in a]
        assert ran == CUSTOM["split-gpipe-lifo.csv"].splitlines()[rank].split(","), (rank, ran)


def _misfits(pp_group):
    """The errors of schedules that do not fit this 2-rank group or a 4-microbatch step."""
    stage = PipelineStage(torch.nn.Linear(4, 4), dist.get_rank(pp_group), 2, "cpu", group=pp_group)
    errors = []
    for schedule, options in [(S.generate("1f1b", num_ranks=4, num_microbatches=M), {}),
                              (S.generate("1f1b", num_ranks=2, num_microbatches=M + 2), {}),
                              (S.generate("1f1b", num_ranks=2, num_microbatches=M), {"memory_limit": 3})]:
        try:
            build_schedule(schedule, stage, M, loss_fn=torch.nn.functional.mse_loss, **options)
            errors.append(None)
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    return errors


def test_schedule_that_does_not_fit_is_named(ranks):
    per_rank = ranks(2).run(run_configs, [{}], _misfits, timeout=60)
    for rank, (errors,) in enumerate(per_rank):
        assert isinstance(errors, list), errors
        ranks_error, microbatches_error, options_error = errors
        assert "is for 4 ranks but the pipeline group has 2" in ranks_error, (rank, ranks_error)
        assert "runs 6 microbatches but n_microbatches=4" in microbatches_error, (rank, microbatches_error)
        assert options_error.startswith("TypeError") and "memory_limit" in options_error, (rank, options_error)
