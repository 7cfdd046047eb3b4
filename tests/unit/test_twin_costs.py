"""The twin's cost models and its engine's continuous batching, against sums done by hand in
float64 (asyncrl/twin/costs.py, engine.py)."""

from pathlib import Path

import pytest

from asyncrl.twin.capacity import gen_tokens_per_s, train_tokens_per_s
from asyncrl.twin.costs import EngineCost, LearnerCost, PushCost, engine_cost_from_hardware, kv_capacity_tokens
from asyncrl.twin.engine import Request, SimEngine
from asyncrl.twin.events import EventQueue
from asyncrl.twin.scenario import load_scenario

SCENARIO = Path(__file__).resolve().parents[2] / "configs" / "twin" / "areal_math_1p5b_1node.yaml"
COST = EngineCost(c0_s=0.010, c_seq_s=0.001, c_ctx_s=1e-5, c_prefill_s=1e-4)


def stepwise(k, batch, context, prefill):
    return prefill * 1e-4 + sum(0.010 + 0.001 * batch + 1e-5 * (context + i * batch) for i in range(k))


@pytest.mark.parametrize("k,batch,context,prefill", [(1, 1, 0, 0), (7, 3, 100, 50), (1000, 64, 20_000, 4096)])
def test_steps_s_is_the_sum_of_its_steps_and_steps_done_inverts_it(k, batch, context, prefill):
    assert COST.steps_s(k, batch, context, prefill) == pytest.approx(stepwise(k, batch, context, prefill), rel=1e-12)
    t = COST.steps_s(k, batch, context, prefill)
    assert COST.steps_done(t, batch, context, prefill) == k
    assert COST.steps_done(t - 1e-9, batch, context, prefill) == k - 1
    assert COST.steps_done(prefill * 1e-4 - 1e-9, batch, context, prefill) == 0


def test_costs_from_hardware():
    # 1.5e9 params in bf16 (3e9 bytes), 28672 B of KV a token, one GPU of 1e15 FLOP/s and 3e12 B/s at 0.5
    c = engine_cost_from_hardware(1.5e9, 3e9, 28672, 1, 1e15, 3e12, 0.5, 0.5, 0.001)
    assert c.c0_s == pytest.approx(0.001 + 3e9 / 1.5e12)
    assert c.c_ctx_s == pytest.approx(28672 / 1.5e12)
    assert c.c_seq_s == c.c_prefill_s == pytest.approx(2 * 1.5e9 / 0.5e15)
    assert kv_capacity_tokens(1, 80 * 2**30, 0.9, 3e9, 28672) == int((80 * 2**30 * 0.9 - 3e9) // 28672)
    with pytest.raises(ValueError, match="do not fit"):
        kv_capacity_tokens(1, 8 * 2**30, 0.3, 3e9, 28672)
    lc = LearnerCost(params=1e9, gpus=4, peak_flops=1e15, mfu=0.5, fixed_s=2.0, per_token_s=1e-6)
    assert lc.step_s(1000) == pytest.approx(2.0 + 1e-3 + 6 * 1e9 * 1000 / 2e15)
    pc = PushCost(weight_bytes=3e9, bucket_bytes=2**28, alpha_s=1e-5, beta_bytes_per_s=5e10, load_bytes_per_s=1e11,
                  fixed_s=0.1)
    assert pc.buckets() == 12  # ceil(3e9 / 268435456)
    assert pc.push_s() == pytest.approx(0.1 + 12 * 1e-5 + 3e9 / 5e10 + 3e9 / 1e11)


def test_a_colocated_layout_pays_its_switch_on_every_push_and_a_split_one_does_not():
    sc = load_scenario(SCENARIO, ["push.fixed_s=0.5", "push.switch_s=74"])
    split, colocated = sc.push_cost(), sc.for_mode("sync").push_cost()
    assert split.fixed_s == 0.5 and colocated.fixed_s == 74.5
    assert sc.for_mode("colocate_async").push_cost().fixed_s == 74.5
    assert colocated.push_s() - split.push_s() == pytest.approx(74.0)  # one node: the same link either way


def test_a_delta_push_moves_a_gap_and_a_value_per_changed_element_and_loads_the_whole_weights():
    # 3e9 bytes of bf16 weights, 2% of elements changed: 0.02 x 3e9 x (2 + 2) / 2 = 1.2e8 bytes
    pc = PushCost(weight_bytes=3e9, bucket_bytes=2**28, alpha_s=1e-5, beta_bytes_per_s=5e10, load_bytes_per_s=1e11,
                  fixed_s=0.1, changed_frac=0.02, bytes_per_param=2)
    assert pc.payload_bytes() == pytest.approx(1.2e8) and pc.buckets() == 1
    assert pc.push_s() == pytest.approx(0.1 + 1e-5 + 1.2e8 / 5e10 + 3e9 / 1e11)
    assert pc.push_s(full=True) == pytest.approx(0.1 + 12 * 1e-5 + 3e9 / 5e10 + 3e9 / 1e11)
    # past half the elements changed a delta is no smaller: the push is whole
    assert PushCost(3e9, 2**28, 0.0, 5e10, 1e11, changed_frac=0.5).payload_bytes() == 3e9
    # the learner's search for the changed elements: every weight byte compared, before a delta's broadcast only
    slow = PushCost(3e9, 2**28, 1e-5, 5e10, 1e11, fixed_s=0.1, changed_frac=0.02, encode_bytes_per_s=3e9)
    assert slow.push_s() == pytest.approx(0.1 + 3e9 / 3e9 + 1e-5 + 1.2e8 / 5e10 + 3e9 / 1e11)
    assert slow.push_s(full=True) == pc.push_s(full=True)


def test_a_scenario_pushes_whole_every_full_every_versions_and_never_under_full():
    full = load_scenario(SCENARIO)
    assert all(full.full_push(v) for v in range(1, 9)) and full.push_cost().changed_frac == 1.0
    delta = load_scenario(SCENARIO, ["push.transfer=delta", "push.changed_frac=0.01", "push.full_every=4"])
    assert [v for v in range(1, 9) if delta.full_push(v)] == [4, 8]
    assert delta.push_cost().payload_bytes() == pytest.approx(delta.model.weight_bytes * 0.01 * 2)
    assert delta.push_cost().encode_s() == pytest.approx(delta.model.weight_bytes / 2e9)
    assert full.push_cost().encode_s() == 0.0  # transfer full compares nothing
    assert not any(load_scenario(SCENARIO, ["push.transfer=delta"]).full_push(v) for v in range(1, 9))


def test_capacity_formulas():
    c = EngineCost(0.01, 0.0, 0.0, 0.0)
    # constant lengths: context prompt + L/2; batch min(8, 10_000 // 150) = 8; 2 engines of 8 tokens per 10 ms
    assert gen_tokens_per_s(c, 2, 8, 10_000, 100, 100.0, 100.0 ** 2) == pytest.approx(1600.0)
    # the cache holds 3 requests of 150 tokens' average context
    assert gen_tokens_per_s(c, 1, 8, 450, 100, 100.0, 100.0 ** 2) == pytest.approx(300.0)
    lc = LearnerCost(params=1.0, gpus=1, peak_flops=1e30, mfu=1.0, fixed_s=0.5, per_token_s=1e-3)
    pc = PushCost(1.0, 1.0, 0.0, 1e30, 1e30, fixed_s=0.5)
    # Phi 1000 with prompts 1/10 of a response: 1100 tokens forwarded, 0.5 + 1.1 + 0.5 s a step
    assert train_tokens_per_s(lc, pc, 1000, 10, 100.0) == pytest.approx(1000 / 2.1)


def run_engine(engine, events, until=1e9):
    while events.run_next() and events.now < until:
        pass


def test_one_request_finishes_when_its_steps_say():
    events, done = EventQueue(), []
    e = SimEngine(COST, 8, 10_000, events, on_finished=lambda rs, t: done.append((t, [r.generated for r in rs])))
    e.submit([Request(context=100, remaining=5)], 0.0)
    run_engine(e, events)
    assert done == [(pytest.approx(stepwise(5, 1, 100, 100)), [5])]
    assert e.stats.tokens == 5 and e.stats.busy_s == pytest.approx(stepwise(5, 1, 100, 100))


def test_a_request_that_arrives_mid_stretch_joins_at_the_next_step():
    events, done = EventQueue(), []
    e = SimEngine(COST, 8, 10_000, events, on_finished=lambda rs, t: done.append((t, len(rs))))
    e.submit([Request(context=10, remaining=10)], 0.0)
    first = stepwise(1, 1, 10, 10)
    events.at(first + 1e-6, lambda t: e.submit([Request(context=10, remaining=2)], t))
    run_engine(e, events)
    # step 2 of the first request runs alone (ends at first + step(1 request, 11 tokens)); then the
    # second is prefilled and both decode: it finishes 2 steps later, the first 6 steps after that
    t2 = first + stepwise(1, 1, 11, 0)
    t3 = t2 + stepwise(2, 2, 12 + 10, 10)
    t4 = t3 + stepwise(6, 1, 14, 0)
    assert [t for t, _ in done] == [pytest.approx(t3), pytest.approx(t4)]


def test_a_full_cache_preempts_the_newest_request_and_recomputes_it():
    events, done = EventQueue(), []
    e = SimEngine(EngineCost(1.0, 0.0, 0.0, 0.0), 8, 30, events, on_finished=lambda rs, t: done.append((t, rs)))
    a, b = Request(context=10, remaining=10), Request(context=10, remaining=10)
    e.submit([a, b], 0.0)
    run_engine(e, events)
    # both start (20 + 2 <= 30); after 5 steps the context is 30 and the next would overflow: b
    # goes back; a finishes 5 steps later (t 10); then b is prefilled again with its 15 tokens
    assert e.stats.preemptions == 1
    assert [(t, r.generated) for t, [r] in done] == [(10.0, 10), (15.0, 10)]


def test_abort_hands_everything_back_at_the_end_of_the_running_step():
    events, back = EventQueue(), []
    e = SimEngine(EngineCost(1.0, 0.0, 0.0, 0.0), 1, 100, events, on_finished=lambda rs, t: None)
    e.submit([Request(context=4, remaining=10), Request(context=4, remaining=10)], 0.0)
    events.at(2.5, lambda t: e.abort(t, lambda rs, t: back.append((t, [(r.generated, r.context) for r in rs]))))
    run_engine(e, events)
    # max_num_seqs 1: the first ran 3 steps (the third ends at t 3), the second never started
    assert back == [(3.0, [(3, 7), (0, 4)])]
    assert e.idle and e.empty


def test_the_engine_reports_when_it_starts_and_stops_computing():
    events, changes = EventQueue(), []
    e = SimEngine(EngineCost(1.0, 0.0, 0.0, 0.0), 8, 100, events, on_finished=lambda rs, t: None,
                  on_busy=lambda busy, t: changes.append((busy, t)))
    e.submit([Request(context=4, remaining=3)], 0.0)
    events.at(1.5, lambda t: e.submit([Request(context=4, remaining=1)], t))  # joins; no change
    run_engine(e, events)
    events.at(10.0, lambda t: e.submit([Request(context=4, remaining=2)], t))
    events.at(10.5, lambda t: e.abort(t, lambda rs, t: None))
    run_engine(e, events)
    assert changes == [(True, 0.0), (False, 3.0), (True, 10.0), (False, 11.0)]


def test_pause_keeps_requests_and_their_context_and_resume_decodes_on_with_no_prefill():
    """c_prefill 1 s a token: a prefill would show. Two requests of 4 prompt tokens start at t 0
    (8 s of prefill + 1 s step), pause at the end of the step running at 10.5 s (t 11, 3 tokens
    each), resume at 20 and finish their last 7 steps by 27, with nothing prefilled again."""
    events, paused, done = EventQueue(), [], []
    e = SimEngine(EngineCost(1.0, 0.0, 0.0, 1.0), 8, 100, events, on_finished=lambda rs, t: done.append(t))
    e.submit([Request(context=4, remaining=10), Request(context=4, remaining=10)], 0.0)
    events.at(10.5, lambda t: e.pause(t, lambda rs, t: paused.append((t, [(r.generated, r.context) for r in rs]))))
    events.at(20.0, lambda t: e.resume(t))
    run_engine(e, events)
    assert paused == [(11.0, [(3, 7), (3, 7)])] and not e.paused
    assert done == [27.0] and e.stats.prefill_tokens == 8 and e.stats.reprefill_tokens == 0
    # busy 0-11 and 20-27; occupancy: 2 requests running over those 18 s
    assert e.stats.busy_s == pytest.approx(18.0)
    assert sum(e.stats.running_by_bin.values()) == pytest.approx(36.0)


def test_a_resumed_request_prefilling_its_prefix_is_counted_as_reprefill():
    events = EventQueue()
    e = SimEngine(EngineCost(1.0, 0.0, 0.0, 0.5, c_request_s=0.25), 8, 100, events, on_finished=lambda rs, t: None)
    e.submit([Request(context=4, remaining=2), Request(context=9, remaining=2, resumed=True)], 0.0)
    run_engine(e, events)
    # the first step prefills 13 tokens and starts 2 requests; the resumed one's share is its 9
    # tokens at 0.5 s and its start at 0.25 s
    assert e.stats.prefill_tokens == 13 and e.stats.reprefill_tokens == 9
    assert e.stats.reprefill_s == pytest.approx(9 * 0.5 + 0.25)
    assert e.stats.busy_s == pytest.approx(13 * 0.5 + 2 * 0.25 + 2 * 1.0)
