"""torch.distributed.pipelining's schedule vocabulary in torchpp.pipeline: the action strings
parse to the same tuples and print back, CSV files round-trip through the compiler, the
validator rejects what torch's rejects (as an AssertionError), stage placements and schedule
names map as torch's do, and torch's internal passes torchpp replaces raise naming its own."""
from __future__ import annotations

import pytest
import torch.distributed.pipelining._utils as torch_utils
import torch.distributed.pipelining.schedules as torch_schedules

import torchpp.pipeline as pp
import torchpp.pipeline.schedules as ours
from torchpp import schedule as S
from torchpp.pipeline import actions as A

STRINGS = ["1F0", "2I1", "0W3", "0B3", "1UNSHARD", "3RESHARD", "2SEND_B2", "1RECV_F1", "12F105", "0REDUCE_GRAD",
           "(0F7;7B3)OVERLAP_F_B"]


@pytest.mark.parametrize("text", STRINGS)
def test_action_strings_parse_like_torchs_and_print_back(text):
    mine, theirs = ours._Action.from_str(text), torch_schedules._Action.from_str(text)
    assert repr(mine) == str(mine) == repr(theirs) == text
    assert (mine.stage_index, mine.computation_type.value, mine.microbatch_index) == \
        (theirs.stage_index, theirs.computation_type.value, theirs.microbatch_index)
    assert mine.is_compute_op == theirs.is_compute_op
    assert [repr(a) for a in mine.sub_actions or ()] == [repr(a) for a in theirs.sub_actions or ()]


def test_module_level_vocabulary_is_torchs():
    for name in ("F", "I", "W", "B", "FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FULL_BACKWARD", "SEND_F",
                 "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD", "OVERLAP_F_B"):
        assert getattr(ours, name).value == getattr(torch_schedules, name).value, name
    assert ours._Action(0, ours.F, 3) == ours._Action.from_str("0F3")
    assert ours._Action(1, ours.UNSHARD, None) == ours._Action.from_str("1UNSHARD")
    assert ours._Action.from_str("  ") is None  # an idle cell


@pytest.mark.parametrize("bad", ["F0", "0X1", "0FF1", "(0F1;1B0)NOPE"])
def test_malformed_action_strings_are_named(bad):
    with pytest.raises(RuntimeError, match="not an action string|unknown computation type"):
        A.Action.from_str(bad)


def test_csv_round_trips_and_runs_through_the_compiler(tmp_path):
    sch = S.generate("zb-h1", num_ranks=2, num_microbatches=4)
    order = {r: [A.Action.from_str(a) for a in sch.actions(r)] for r in range(2)}
    order[1].insert(0, None)  # torch writes idle steps as empty cells
    path = str(tmp_path / "zb.csv")
    A.write_csv(order, path)
    assert open(path).read().splitlines()[1].startswith(",1F0")
    back = A.read_csv(path)
    assert back == order
    rebuilt = A.to_schedule(back, num_ranks=2, num_microbatches=4)
    assert [rebuilt.actions(r) for r in range(2)] == [sch.actions(r) for r in range(2)]
    # torch's reader sees the same actions
    theirs = {r: [torch_schedules._Action.from_str(c) for c in row.split(",")]
              for r, row in enumerate(open(path).read().splitlines())}
    assert {r: [repr(a) for a in acts] for r, acts in theirs.items()} == \
        {r: ["None" if a is None else repr(a) for a in acts] for r, acts in back.items()}


def test_overlapped_pairs_and_fsdp_actions_reach_the_compiler_as_their_compute_actions():
    order = A.parse_order({0: ["0UNSHARD", "0F0", "0F1", "(1F0;0B0)OVERLAP_F_B", "1B0", "0B1", "0RESHARD"]})
    assert A.csv_text(order, 1).strip() == "0F0,0F1,1F0,0B0,1B0,0B1"


def test_validator_raises_an_assertion_error_naming_the_problem():
    ok = {0: ["0F0", "0B0"], 1: ["1F0", "1B0"]}
    assert ours._validate_schedule(A.parse_order(ok), 2, 2, 1) == {0: 0, 1: 1}
    split = {0: ["0F0", "0I0", "0W0"], 1: ["1F0", "1I0", "1W0"]}
    ours._validate_schedule(A.parse_order(split), 2, 2, 1)
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\]"):
        ours._validate_schedule(A.parse_order({0: ["0F0", "0B0"]}), 2, 2, 1)
    with pytest.raises(AssertionError):
        ours._validate_schedule(A.parse_order({0: ["0F0"], 1: ["1F0"]}), 2, 2, 1)
    with pytest.raises(AssertionError, match="3 stages, expected 2"):
        ours._validate_schedule(A.parse_order({0: ["0F0", "2F0", "2B0", "0B0"], 1: ["1F0", "1B0"]}), 2, 2, 1)


def test_merge_bw_fuses_adjacent_input_and_weight_backwards():
    merged = ours._merge_bw([A.Action.from_str(a) for a in ["0F0", "0F1", "0I0", "0W0", "0I1", "1W1", "0W1"]]
                            + [None])
    assert [repr(a) for a in merged] == ["0F0", "0F1", "0B0", "0I1", "1W1", "0W1"]


@pytest.mark.parametrize("style", ["loop", "v"])
@pytest.mark.parametrize("pp_size,num_stages", [(2, 2), (2, 4), (4, 8), (4, 12), (3, 9)])
def test_stage_to_rank_mapping_is_torchs(style, pp_size, num_stages):
    assert pp.generate_stage_to_rank_mapping(pp_size, num_stages, style) == \
        torch_utils.generate_stage_to_rank_mapping(pp_size, num_stages, style)


def test_stage_to_rank_mapping_errors_name_the_value():
    with pytest.raises(ValueError, match="'zigzag'"):
        pp.generate_stage_to_rank_mapping(2, 4, "zigzag")
    with pytest.raises(ValueError, match=r"num_stages \(5\) divisible by pp_size \(2\)"):
        pp.generate_stage_to_rank_mapping(2, 5, "v")


@pytest.mark.parametrize("name", ["1F1B", "1f1b", "Interleaved1F1B", "INTERLEAVED1F1B", "GPipe", "LoopedBFS",
                                  "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "PipelineScheduleSingle",
                                  "PipelineScheduleMulti"])
def test_get_schedule_class_maps_torchs_names_to_torchpps_classes(name):
    cls = ours.get_schedule_class(name)
    assert cls.__name__ == torch_schedules.get_schedule_class(name).__name__
    assert issubclass(cls, ours._PipelineSchedule) and issubclass(cls, pp.PipelineSchedule)


def test_unknown_schedule_name_is_named():
    with pytest.raises(ValueError, match="ScheduleThatDoesNotExist"):
        ours.get_schedule_class("ScheduleThatDoesNotExist")


@pytest.mark.parametrize("name", ["_add_send_recv", "_simulate_comms_compute", "_add_unshard_reshard",
                                  "_add_reduce_grad"])
def test_torchs_internal_passes_raise_naming_torchpps_counterpart(name):
    with pytest.raises(NotImplementedError, match=f"{name} is one of torch's Python lowering.*use torchpp"):
        getattr(ours, name)({0: []}, lambda s: 0, 1)


def test_every_name_torch_exports_exists_in_torchpp():
    import torch.distributed.pipelining as theirs

    for name in list(theirs.__all__) + ["_ScheduleForwardOnly"]:
        assert hasattr(pp, name), name
    for name in ("_Action", "_ComputationType", "_PipelineSchedule", "_PipelineScheduleRuntime",
                 "PipelineScheduleSingle", "PipelineScheduleMulti", "get_schedule_class", "_PipelineContext",
                 "_wait_batch_p2p", "_format_pipeline_order", "_validate_schedule"):
        assert hasattr(ours, name), name
    from torchpp.pipeline.stage import _PipelineStageBase
    from torchpp.pipeline._utils import PipeliningMetadataError

    assert _PipelineStageBase is pp.PipelineStage and issubclass(PipeliningMetadataError, RuntimeError)
