"""The driver without Ray: built from a config by `build_driver`, turned by hand as the orchestrator
turns it (grants out, samples and rewards in, a StepBatch out), with the real ledger, stage
runner and reward pool (worker processes, a deterministic verifier)."""

import time

import pytest

from asyncrl.config import load_config
from asyncrl.observe.metrics import MetricsWriter
from asyncrl.orchestrator.driver import build_driver
from asyncrl.tiny.tokenizer import save_tokenizer
from asyncrl.types import Sample

N = 2  # samples per prompt


@pytest.fixture
def driver(tmp_path):
    save_tokenizer(tmp_path)
    stages = "[{steps: 1, token_budget: 8}, {token_budget: 6}]"
    cfg = load_config(None, [
        "reward.type=import:asyncrl.reward.fault_injection:by_response_hash", "reward.num_workers=1",
        f"rollout.group_size={N}", "rollout.max_tokens=4", "buffer.max_staleness=1", f"stages={stages}",
        "rollout.max_in_flight_prompts=2", "eval.every_steps=0", "algo.drop_zero_variance_groups=false",
        "observe.tensorboard=false", f"observe.output_dir={tmp_path}", "model.max_model_len=64"])
    d = build_driver(cfg, str(tmp_path), MetricsWriter(tmp_path / "run", tensorboard=False), say=lambda _: None)
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
    row = driver.step_metrics(1, frames_dropped=0)
    assert row["reward/num_samples"] == prompts * N and row["buffer/loss_tokens"] == prompts * N * 4 - 8
    assert row["ledger/groups_kept_total"] == prompts and row["rollout/frames_dropped_total"] == 0
    # the first stage ends after step 1: Phi 6 from the next batch on
    change = driver.end_step(1, row["reward/mean"])
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
