"""The entropy coefficient's schedule over rollout batches (Skywork-OR1 3.2.5: c moves once per
training step, i.e. per rollout batch), by hand with tgt 0.5 and Delta 0.1."""

import pytest

from asyncrl.config import AlgoConfig
from asyncrl.learner.entropy_schedule import EntropySchedule, sampled_nll_sum
from asyncrl.types import SequenceChunk


def schedule(measure):
    return EntropySchedule(AlgoConfig(entropy_control={"enabled": True, "target": 0.5, "delta": 0.1,
                                                       "measure": measure, "coef_max": None}))


def test_fixed_coefficient_without_control():
    s = EntropySchedule(AlgoConfig(entropy_coef=0.003))
    assert [s.coef(role)[0] for role in ("own", "open", "continue")] == [0.003] * 3


def test_exact_moves_once_per_rollout_batch_with_the_batch_e_k():
    s = schedule("exact")
    # batch 1 (e_k 0.4 < tgt): alpha = c_0 = 0 for its 3 steps, c -> 0.1
    # batch 2 (e_k 0.3 < tgt): alpha = c_1 = 0.1 for its 3 steps, c -> 0.2
    # batch 3 (e_k 0.6 > tgt): alpha = 0 (indicator), c -> 0.1
    got = []
    for e_k in (0.4, 0.3, 0.6):
        got += [s.coef("open", e_k)[0], s.coef("continue")[0], s.coef("continue")[0]]
    assert got == pytest.approx([0.0] * 3 + [0.1] * 3 + [0.0] * 3, abs=1e-15)
    assert s.controller.num_updates == 3 and s.controller.coef == pytest.approx(0.1, abs=1e-15)
    assert s.coef("continue")[1]["entropy_control/measured"] == 0.6


def test_exact_needs_the_measured_entropy():
    with pytest.raises(ValueError, match="need e_k of the step"):
        schedule("exact").coef("open")


def test_lagged_uses_the_previous_batch_token_weighted():
    s = schedule("lagged")
    assert s.coef("open")[0] == 0.0 and s.controller.num_updates == 0  # no e_0 yet
    s.observe(0.2, 100)
    s.observe(0.8, 300)  # the batch's e = (0.2 * 100 + 0.8 * 300) / 400 = 0.65 > tgt
    assert s.coef("open")[0] == 0.0
    assert s.measured == pytest.approx(0.65, abs=1e-15) and s.controller.coef == 0.0
    s.observe(0.3, 50)  # one step: its own mean
    assert s.coef("own")[0] == 0.0 and s.measured == 0.3 and s.controller.coef == pytest.approx(0.1)
    s.observe(0.35, 10)
    assert s.coef("own")[0] == pytest.approx(0.1) and s.controller.coef == pytest.approx(0.2)


def test_state_round_trip_inside_a_batch():
    a = schedule("lagged")
    a.observe(0.3, 10)
    a.coef("open")
    a.observe(0.4, 30)  # a checkpoint inside the open batch
    b = schedule("lagged")
    b.load_state_dict(a.state_dict())
    assert b.coef("continue")[0] == a.coef("continue")[0]
    b.observe(0.2, 10)
    a.observe(0.2, 10)
    assert b.coef("open") == a.coef("open")
    assert b.measured == pytest.approx((0.4 * 30 + 0.2 * 10) / 40, abs=1e-15)


def test_sampled_nll_takes_e_k_from_the_behaviour_logprobs_when_a_batch_opens():
    s = schedule("sampled_nll")
    assert s.needs_measure("open") and s.needs_measure("own") and not s.needs_measure("continue")
    chunks = [SequenceChunk("g", 0, [1], [5, 6], 0, [-0.25, -0.5], [0, 0], 1.0),
              SequenceChunk("g", 1, [1], [5, 6, 7], 1, [-0.125, -0.375], [0, 0], 1.0)]
    assert sampled_nll_sum(chunks) == 1.25  # 0.25 + 0.5 + 0.125 + 0.375
    # e_k = 1.25 / 4 = 0.3125 < tgt 0.5: alpha = c_0 = 0, c -> 0.1
    assert s.coef("open", sampled_nll_sum(chunks) / 4)[0] == 0.0
    assert s.controller.coef == pytest.approx(0.1) and s.measured == 0.3125
    with pytest.raises(ValueError, match="need e_k"):
        s.coef("own")


def test_the_coefficient_is_capped_by_default_as_the_released_scripts_cap_it():
    s = EntropySchedule(AlgoConfig(entropy_control={"enabled": True, "target": 0.5, "delta": 0.004}))
    alphas = [s.coef("own", 0.1)[0] for _ in range(4)]  # below target: c rises 0.004 a step, to 0.005
    assert alphas == pytest.approx([0.0, 0.004, 0.005, 0.005], abs=1e-15)
