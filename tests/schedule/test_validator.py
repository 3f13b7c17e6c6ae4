"""The validator names what broke and marks the offending step in the rank x step grid."""
import pytest

from torchpp import schedule as S


def load(tmp_path, rows, p, m, lowered_ok=True):
    path = str(tmp_path / "s.csv")
    with open(path, "w") as f:
        f.write("\n".join(",".join(row) for row in rows) + "\n")
    return lambda: S.from_csv(path, num_ranks=p, num_microbatches=m)


def test_backward_before_forward(tmp_path):
    loader = load(tmp_path, [["0B0", "0F0"]], 1, 1)
    with pytest.raises(S.ScheduleError, match="0B0 runs before its forward 0F0") as info:
        loader()
    assert ">0B0<" in str(info.value) and "<-- here" in str(info.value)


def test_weight_before_input_gradient(tmp_path):
    with pytest.raises(S.ScheduleError, match="0W0 runs before its input-gradient pass 0I0"):
        load(tmp_path, [["0F0", "0W0", "0I0"]], 1, 1)()


def test_missing_microbatch(tmp_path):
    with pytest.raises(S.ScheduleError, match="stage 0 microbatch 1 has no F"):
        load(tmp_path, [["0F0", "0B0"]], 1, 2)()


def test_duplicate_action(tmp_path):
    with pytest.raises(S.ScheduleError, match="0F0 is scheduled twice"):
        load(tmp_path, [["0F0", "0F0", "0B0"]], 1, 1)()


def test_stage_on_two_ranks(tmp_path):
    with pytest.raises(ValueError, match="a stage lives on exactly one rank"):
        load(tmp_path, [["0F0", "1F0", "1B0", "0B0"], ["0F1"]], 2, 2)()


def test_deadlock_marks_the_blocked_steps(tmp_path):
    # rank 0 waits for the gradient of microbatch 0 before sending microbatch 1 forward, while
    # rank 1 waits for microbatch 1 before sending that gradient
    rows = [["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
    with pytest.raises(S.ScheduleError, match="deadlocks") as info:
        load(tmp_path, rows, 2, 2)()
    message = str(info.value)
    assert "rank 0 step 1: 0B0 waits for the input gradient of stage 1 microbatch 0" in message
    assert "rank 1 step 1: 1F1 waits for the forward of stage 0 microbatch 1" in message
    assert ">0B0<" in message and ">1F1<" in message


def test_crossed_sends_and_receives(tmp_path):
    rows = [["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
            ["1RECV_F1", "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"]]
    with pytest.raises(S.ScheduleError, match="do not match in order") as info:
        load(tmp_path, rows, 2, 2)()
    assert ">1RECV_F1<" in str(info.value)


def test_recv_missing_before_consumer(tmp_path):
    rows = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1F0", "1RECV_F0", "1B0", "1SEND_B0"]]
    with pytest.raises(S.ScheduleError, match="1F0 has no RECV_F posted before it"):
        load(tmp_path, rows, 2, 1)()


@pytest.mark.parametrize("name", S.SCHEDULES)
def test_lowering_pairs_every_cross_rank_boundary(name):
    p, m = 4, 8
    sch = S.generate(name, p, m)
    low = sch.lowered()
    low.validate()
    sends = [a for r in range(p) for a in low.actions(r) if "SEND" in a]
    recvs = [a for r in range(p) for a in low.actions(r) if "RECV" in a]
    crossings = 0
    for stage in range(sch.num_stages - 1):
        same_pipeline = sch.num_pipelines == 1 or stage % (sch.num_stages // 2) != sch.num_stages // 2 - 1
        if same_pipeline and sch.stage_to_rank[stage] != sch.stage_to_rank[stage + 1]:
            crossings += 1
    per_pipeline = m // sch.num_pipelines
    assert len(sends) == len(recvs) == 2 * crossings * per_pipeline
    assert low.compute_only().actions(0) == sch.actions(0)


def test_v_shape_turn_has_no_communication():
    low = S.generate("zb-v", 4, 8).lowered()
    last = low.actions(3)  # rank 3 holds stages 3 and 4: the turn of the V stays on the rank
    assert not any(a.startswith("3SEND_F") or a.startswith("4RECV_F") for a in last)
    assert not any(a.startswith("4SEND_B") or a.startswith("3RECV_B") for a in last)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-v", "dualpipe"])
def test_in_order_lowering_never_blocks_where_the_tagged_one_does(name):
    """The blocking in-order model (NCCL) rejects the tagged lowering, which relies on tags and
    non-blocking sends, and accepts the in-order one; both stay valid schedules."""
    sch = S.generate(name, 4, 8)
    with pytest.raises(S.ScheduleError, match="deadlocks on an in-order transport") as info:
        sch.lowered().check_in_order_p2p()
    assert "waits on" in str(info.value)
    in_order = sch.lowered(in_order=True)
    in_order.validate()
    in_order.check_in_order_p2p()
    assert in_order.compute_only().actions(0) == sch.actions(0)


@pytest.mark.parametrize("name", S.SCHEDULES)
def test_forward_only_keeps_each_ranks_forward_order_and_lowers(name):
    """An evaluation step: the F actions in the schedule's order, one SEND_F/RECV_F pair per
    cross-rank activation and no gradient messages, tagged or in order."""
    p, m = 4, 8
    sch = S.generate(name, p, m)
    forward = sch.forward_only()
    for r in range(p):
        assert forward.actions(r) == [a for a in sch.actions(r) if a.lstrip("0123456789")[0] == "F"]
    for in_order in (False, True):
        low = forward.lowered(in_order=in_order)
        if in_order:
            low.check_in_order_p2p()
        assert low.compute_only().actions(1) == forward.actions(1)
        messages = [a.lstrip("0123456789") for r in range(p) for a in low.actions(r) if "SEND" in a or "RECV" in a]
        full = [a for r in range(p) for a in sch.lowered().actions(r) if "SEND_F" in a or "RECV_F" in a]
        assert sorted(set(k[:6] for k in messages)) == ["RECV_F", "SEND_F"]
        assert len(messages) == len(full)


def test_in_order_check_needs_a_lowered_schedule():
    with pytest.raises(S.ScheduleError, match="needs a lowered schedule"):
        S.generate("1f1b", 2, 4).check_in_order_p2p()
