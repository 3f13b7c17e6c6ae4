"""Action strings and CSV files interchange with torch.distributed.pipelining; golden CSVs pin
a few schedules; each rank's loss microbatches follow from where the last stages are."""
import csv
import os

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from torchpp import schedule as S

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def golden_files():
    return sorted(f for f in os.listdir(GOLDEN) if f.endswith(".csv"))


def golden_spec(filename):
    """'interleaved-1f1b_p4_m8_v2.csv' -> ('interleaved-1f1b', 4, 8, 2, lowered=False)."""
    parts = filename[:-4].split("_")
    lowered = parts[-1] == "lowered"
    fields = {part[0]: int(part[1:]) for part in parts[1:] if part[0] in "pmv" and part[1:].isdigit()}
    return parts[0], fields["p"], fields["m"], fields.get("v"), lowered


@pytest.mark.parametrize("filename", golden_files())
def test_golden_schedules_unchanged(filename):
    name, p, m, v, lowered = golden_spec(filename)
    sch = S.generate(name, p, m, num_chunks=v)
    if lowered:
        sch = sch.lowered()
    loaded = S.from_csv(os.path.join(GOLDEN, filename), num_ranks=p, num_microbatches=m)
    assert loaded.is_lowered == lowered
    assert loaded.stage_to_rank == sch.stage_to_rank
    assert loaded.num_pipelines == sch.num_pipelines
    for r in range(p):
        assert loaded.actions(r) == sch.actions(r), f"{filename} rank {r} differs from the generator"


@pytest.mark.parametrize("name", S.SCHEDULES)
def test_action_strings_parse_in_torch(name, tmp_path):
    p, m = 4, 8
    sch = S.generate(name, p, m).lowered()
    for r in range(p):
        for action in sch.actions(r):
            assert str(torch_schedules._Action.from_str(action)) == action


@pytest.mark.parametrize("name", S.SCHEDULES)
def test_csv_round_trip(name, tmp_path):
    sch = S.generate(name, 4, 8)
    for variant in (sch, sch.lowered()):
        path = str(tmp_path / "s.csv")
        variant.to_csv(path)
        back = S.from_csv(path, num_ranks=4, num_microbatches=8)
        assert [back.actions(r) for r in range(4)] == [variant.actions(r) for r in range(4)]
        assert back.stage_to_rank == variant.stage_to_rank and back.num_pipelines == variant.num_pipelines


class _Stage:
    """Just what torch's schedule constructors read from a stage."""

    def __init__(self, index, num_stages, group_size, rank):
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = group_size, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = torch.nn.Identity()
        self.stage_index_to_group_rank = {}


@pytest.mark.parametrize("cls,v_shape", [(torch_schedules.ScheduleInterleaved1F1B, False),
                                         (torch_schedules.ScheduleInterleavedZeroBubble, False),
                                         (torch_schedules.ScheduleZBVZeroBubble, True)])
def test_torch_csv_loads_validates_and_simulates(cls, v_shape, tmp_path):
    p, m = 4, 8
    stage_ids = [0, 2 * p - 1] if v_shape else [0, p]
    torch_schedule = cls([_Stage(i, 2 * p, p, 0) for i in stage_ids], m)
    path = str(tmp_path / "torch.csv")
    with open(path, "w", newline="") as f:  # torch's _dump_csv: None becomes an empty cell
        writer = csv.writer(f)
        for rank in sorted(torch_schedule.pipeline_order):
            writer.writerow(torch_schedule.pipeline_order[rank])
    ours = S.from_csv(path, num_ranks=p, num_microbatches=m)
    expected = [[str(a) for a in torch_schedule.pipeline_order[r] if a is not None] for r in range(p)]
    assert [ours.actions(r) for r in range(p)] == expected
    ours.lowered().validate()
    assert S.simulate(ours).makespan > 0


@pytest.mark.parametrize("bad", ["F3", "0X3", "0F", "0SEND3", "1F3x"])
def test_malformed_action_string(bad, tmp_path):
    path = str(tmp_path / "bad.csv")
    with open(path, "w") as f:
        f.write(f"0F0,{bad},0B0\n")
    with pytest.raises(ValueError, match="invalid action string"):
        S.from_csv(path, num_ranks=1, num_microbatches=1)


def test_empty_cells_are_idle_steps(tmp_path):
    path = str(tmp_path / "idle.csv")
    with open(path, "w") as f:
        f.write("0F0,,,0B0\n")
    assert S.from_csv(path, num_ranks=1, num_microbatches=1).actions(0) == ["0F0", "0B0"]


def test_loss_microbatches_are_those_of_each_rank_last_stages():
    def per_rank(name):
        sch = S.generate(name, num_ranks=4, num_microbatches=8)
        return [sch.loss_microbatches(rank) for rank in range(4)]

    everything = list(range(8))
    assert per_rank("1f1b") == [[], [], [], everything]
    assert per_rank("interleaved-1f1b") == [[], [], [], everything]
    assert per_rank("zb-v") == [everything, [], [], []]  # the V ends where it starts
    # DualPipe: pipeline 0 (first half of the batch) ends on rank 3, pipeline 1 on rank 0.
    assert per_rank("dualpipe") == [[4, 5, 6, 7], [], [], [0, 1, 2, 3]]
