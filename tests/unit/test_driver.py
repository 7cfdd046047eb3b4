"""The driver without Ray: built from a config by `build_driver`, turned by hand as the orchestrator
turns it (grants out, samples and rewards in, a StepBatch out), with the real ledger, stage
runner and reward pool (worker processes, a deterministic verifier)."""

import time

import pytest

from asyncrl.config import load_config
from asyncrl.observe.metrics import MetricsWriter
from asyncrl.orchestrator.driver import BOOKKEEPING_S, Actions, Grant, StepState, build_driver
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.tiny.tokenizer import save_tokenizer
from asyncrl.types import Sample

N = 2  # samples per prompt


def make_driver(tmp_path, *overrides):
    save_tokenizer(tmp_path)
    cfg = load_config(None, [
        "reward.type=import:asyncrl.reward.fault_injection:by_response_hash", "reward.num_workers=1",
        f"rollout.group_size={N}", "rollout.max_tokens=4", "buffer.max_staleness=1",
        "rollout.max_in_flight_prompts=2", "eval.every_steps=0", "algo.drop_zero_variance_groups=false",
        "observe.tensorboard=false", f"observe.output_dir={tmp_path}", "model.max_model_len=64", *overrides])
    return build_driver(cfg, str(tmp_path), MetricsWriter(tmp_path / "run", tensorboard=False), say=lambda _: None)


@pytest.fixture
def driver(tmp_path):
    d = make_driver(tmp_path, "stages=[{steps: 1, token_budget: 8}, {token_budget: 6}]")
    yield d
    d.rewards.close()


def respond(grant, actor, version=0):
    """What an actor sends back for a grant: n samples of 4 tokens per prompt."""
    return [Sample(p.prompt_id, p.prompt_id, i, p.prompt_ids, [5 + i, 6, 7, 8], [-0.5] * 4, [version] * 4,
                   "stop", actor, p.metadata) for p in grant.prompts for i in range(grant.group_size)]


def scored_all(driver, step, expect, timeout_s=30.0):
    got, deadline = 0, time.monotonic() + timeout_s
    while got < expect and time.monotonic() < deadline:
        got += len(driver.poll_rewards(step, timeout_s=0.05))
    assert got == expect


def test_grants_samples_rewards_and_a_step_batch_of_phi_tokens(driver):
    grants = driver.admit(version=0, actor_ids=[0, 1], step_running=False)
    # each actor gets up to its in-flight cap, least loaded first, all with the stage's settings
    assert {g.actor for g in grants} == {0, 1} and all(len(g.prompts) <= 2 and g.group_size == N for g in grants)
    assert all(g.spec.max_tokens == 4 for g in grants)
    prompts = sum(len(g.prompts) for g in grants)
    assert driver.ledger.generating_by_actor([0, 1]) == {g.actor: len(g.prompts) for g in grants}
    for g in grants:
        driver.ingest(respond(g, g.actor))
    scored_all(driver, step=0, expect=prompts * N)
    assert driver.ledger.accounting()["kept"] == prompts * N  # zero-variance groups kept (switch off)
    batch = driver.next_batch(version=0)
    assert batch.token_budget == 8 and sum(c.num_loss_tokens for c in batch.chunks) == 8
    assert (batch.role, batch.opened, batch.start_version) == ("own", [], None)
    row, change = driver.end_step(1, {}, frames_dropped=0)
    assert row["reward/num_samples"] == prompts * N and row["buffer/loss_tokens"] == prompts * N * 4 - 8
    assert row["ledger/groups_kept_total"] == prompts and row["rollout/frames_dropped_total"] == 0
    # the first stage ends after step 1: Phi 6 from the next batch on
    assert change is not None and change.stage.token_budget == 6
    assert driver.next_batch(version=1).token_budget == 6


def test_state_round_trip_requeues_what_was_in_flight(driver, tmp_path):
    grants = driver.admit(version=0, actor_ids=[0], step_running=False)
    driver.ingest(respond(grants[0], 0)[:1])  # one sample of the first group arrived
    state = driver.state_dict()
    assert state["probe_ids"] is not None and len(state["ledger"]["requeued"]) == len(grants[0].prompts)
    driver.load_state_dict(state)
    assert not driver.ledger.records and len(driver.ledger.requeued) == len(grants[0].prompts)
    again = driver.admit(version=0, actor_ids=[0], step_running=False)  # requeued groups come first
    assert [p.prompt_id for p in again[0].prompts] == [p.prompt_id for p in grants[0].prompts]


SPEC = SamplingSpec(1.0, 1.0, 4)


def land(driver, prompt, version):
    """A group's n samples, generated at policy `version`, arrive and are scored: it is in the buffer."""
    driver.ingest(respond(Grant(0, SPEC, N, [prompt]), 0, version))
    scored_all(driver, step=0, expect=N)


@pytest.mark.parametrize("policy, dropped", [("wait", 0), ("discard", 8)])
def test_wait_holds_the_step_for_a_straggler_until_it_lands(tmp_path, policy, dropped):
    """eta 1, Phi 8 (one group). a and b are admitted at version 0; b is the straggler."""
    d = make_driver(tmp_path, "buffer.token_budget=8", f"buffer.stale_policy={policy}")
    try:
        led = d.ledger
        a, b, c = d.stages.take(3)
        for p in (a, b):
            led.admit(p, 0, SPEC, N, actor=0, version=0)
        land(d, a, version=0)
        # step 0: b would enter at 1 at the latest, 1 behind: nothing at risk yet
        assert {ch.group_id for ch in d.next_batch(0).chunks} == {a.prompt_id}
        led.admit(c, 0, SPEC, N, actor=1, version=1)
        land(d, c, version=1)
        assert led.buffer.num_loss_tokens == 8  # c alone could fill step 1...
        first = d.next_batch(1)
        if policy == "wait":
            # ...but b, admitted at 0, would be 2 behind after it: the learner waits, while b
            # generates and while it is scored
            assert first is None
            b_samples = respond(Grant(0, SPEC, N, [b]), 0, version=0)
            for s in b_samples:
                led.on_generated(s)
            assert led.records[b.prompt_id].state == "scoring" and d.next_batch(1) is None
            row, _ = d.end_step(1, {}, frames_dropped=0)
            assert row["buffer/waiting_for_stragglers"] == 1.0 and row["buffer/straggler_holds_total"] == 2
            for i, s in enumerate(b_samples):
                led.on_scored(s, float(i), {})
            first = d.next_batch(1)  # released: b is older than c, so it goes first
            assert d.end_step(2, {}, frames_dropped=0)[0]["buffer/waiting_for_stragglers"] == 0.0
        else:
            land(d, b, version=0)  # too late: step 1 took c, and at 2 b is 2 behind
        second = d.next_batch(2)
        trained = [{ch.group_id for ch in batch.chunks} for batch in (first, second) if batch is not None]
        assert trained == ([{b.prompt_id}, {c.prompt_id}] if policy == "wait" else [{c.prompt_id}])
        assert led.token_accounting() == {"in": 24, "out": 24 - dropped, "dropped_stale": dropped, "buffered": 0}
    finally:
        d.rewards.close()


@pytest.mark.parametrize("policy", ["pace", "discard"])
def test_pace_admits_nothing_while_an_at_risk_group_generates(tmp_path, policy):
    """eta 1, Phi 8. Before a group is kept, B = Phi / (n * max_tokens / 2) = 8 / 4 = 2 prompts a step."""
    d = make_driver(tmp_path, "buffer.token_budget=8", f"buffer.stale_policy={policy}")
    try:
        [a] = d.stages.take(1)
        d.ledger.admit(a, 0, SPEC, N, actor=0, version=0)
        # AReaL's bound at version 0: (eta + v + 1) * B - running = 2 * 2 - 1; a is not at risk
        assert d.capacity(0, step_running=False) == 3
        # at version 1, a (admitted at 0) is: a + eta < 1 + 1
        paced = policy == "pace"
        assert d.capacity(1, step_running=False) == (0 if paced else 3 * 2 - 1)
        assert (d.admit(1, [0, 1], step_running=False) == []) == paced
        assert d.gate.take_metrics()["buffer/admission_paused"] == float(paced)
        if not paced:
            return
        land(d, a, version=0)
        # back to the bound: a is kept (8 tokens, so B = 1): (1 + 1 + 1) * 1 - 1
        assert d.capacity(1, step_running=False) == 2
        assert d.gate.take_metrics()["buffer/admission_paused"] == 0.0
    finally:
        d.rewards.close()


def test_a_finished_steps_ratio_moments_feed_the_buffers_ess_estimate(driver):
    driver.end_step(1, {"offpolicy/stale_0/ratio_mean": 1.0, "offpolicy/stale_0/ratio_sq_mean": 1.25,
                        "loss/policy": 0.1}, frames_dropped=0)
    assert driver.ledger.buffer.moments.by_bucket == {"stale_0": (1.0, 1.25)}
    grants = driver.admit(version=0, actor_ids=[0], step_running=False)
    for g in grants:
        driver.ingest(respond(g, 0))
    scored_all(driver, step=0, expect=sum(len(g.prompts) for g in grants) * N)
    assert driver.next_batch(0) is not None
    # every token of the cut is fresh: (8 * 1)^2 / (8 * 8 * 1.25)
    assert driver.end_step(2, {}, frames_dropped=0)[0]["buffer/ess_estimate"] == pytest.approx(0.8)
    state = driver.state_dict()
    driver.ledger.buffer.moments.by_bucket = {}
    driver.load_state_dict(state)
    assert driver.ledger.buffer.moments.by_bucket == {"stale_0": (1.0, 1.25)}


class View:
    """A LearnerView: the turn asks its step's state only when bookkeeping is due."""

    def __init__(self, state=StepState.IDLE, stopping=False):
        self.step = self.version = 0
        self.actor_ids, self.state, self.stopping, self.asked = [0, 1], state, stopping, 0

    def step_state(self):
        self.asked += 1
        return self.state


def test_a_turn_ingests_every_time_and_looks_at_admission_and_the_step_every_bookkeeping_period(driver):
    learner = View()
    first = driver.turn(100.0, [], learner)
    assert first.bookkeeping and first.grants and first.batch is None and not first.step_done
    assert learner.asked == 1
    # within the period: the arrivals are ingested and scored, nothing else is looked at
    arrived = [s for g in first.grants for s in respond(g, g.actor)]
    between = driver.turn(100.0 + BOOKKEEPING_S / 2, arrived, learner)
    assert between == Actions() and learner.asked == 1
    assert driver.in_flight() == sum(len(g.prompts) for g in first.grants)
    scored_all(driver, step=0, expect=len(arrived))
    # the period over: the buffer holds Phi, so the idle learner gets its batch
    cut = driver.turn(100.0 + BOOKKEEPING_S, [], learner)
    assert cut.bookkeeping and cut.batch is not None and sum(c.num_loss_tokens for c in cut.batch.chunks) == 8
    assert learner.asked == 2
    learner.state = StepState.TRAINING  # a running step gets no second batch
    assert driver.turn(101.0, [], learner).batch is None
    learner.state = StepState.DONE
    assert driver.turn(102.0, [], learner).step_done


def test_a_stopping_run_is_granted_nothing_and_starts_no_step(driver):
    learner = View(stopping=True)
    acts = driver.turn(100.0, [], learner)
    assert acts.bookkeeping and acts.grants == [] and acts.batch is None and driver.in_flight() == 0
    learner.state = StepState.DONE  # the running step still ends
    assert driver.turn(101.0, [], learner).step_done


def test_admission_by_requests_hands_a_new_prompt_to_an_actor_whose_group_is_half_done(tmp_path):
    """rollout.max_in_flight_requests: the cap counts samples still generating (here 2, one group
    of N = 2), so an actor whose group has sent one of its samples takes another prompt though the
    group is not done; by prompts it would hold its group count."""
    d = make_driver(tmp_path, "rollout.max_in_flight_requests=2", "buffer.token_budget=64")
    try:
        first = d.admit(version=0, actor_ids=[0], step_running=False)
        assert [len(g.prompts) for g in first] == [1] and d.ledger.requests_by_actor([0]) == {0: 2}
        assert d.admit(version=0, actor_ids=[0], step_running=False) == []  # 2 of 2 running
        d.ingest(respond(first[0], 0)[:1])  # one of its two samples is back
        assert d.ledger.requests_by_actor([0]) == {0: 1} and d.ledger.generating_by_actor([0]) == {0: 1}
        more = d.admit(version=0, actor_ids=[0], step_running=False)
        assert [len(x.prompts) for x in more] == [1] and d.ledger.requests_by_actor([0]) == {0: 3}
    finally:
        d.rewards.close()
