"""The loop's scheduling under Ray with fake engines (fast): synchronous mode (max_staleness 0)
trains only on tokens of the current version, and every batch still holds exactly Phi."""

import gc

import pytest

from asyncrl.config import load_config
from asyncrl.orchestrator.orchestrator import Orchestrator


@pytest.mark.parametrize("staleness", [0, 2])
def test_loop_respects_the_staleness_bound_with_exact_budget(ray_cluster, tmp_path, small_model, staleness):
    cfg = load_config(None, [
        f"model.path={small_model}", "rollout.engine=fake", "rollout.num_actors=2", "total_steps=8",
        "buffer.token_budget=48", f"buffer.max_staleness={staleness}", "algo.drop_zero_variance_groups=false",
        "observe.console=off", "observe.tensorboard=false", f"observe.output_dir={tmp_path}", "save_final=false",
        # shaping on: fake responses often run to max_tokens without EOS
        "algo.no_eos_penalty=0.5", "algo.overlong_buffer=4", "algo.truncation_mask=after",
    ])
    orch = Orchestrator(cfg)
    try:
        orch.run()
        actor_versions = [s["version"] for s in orch.pool.stats()]
        collected_automatically = gc.isenabled()
    finally:
        orch.shutdown()
    # the driver ran its garbage collector on its own schedule (collector.py) and gave it back
    assert not collected_automatically and gc.isenabled() and gc.get_freeze_count() == 0
    assert all(h["timing/gc_s"] >= 0 for h in orch.history) and orch.history[-1]["timing/gc_total_s"] >= 0
    assert [h["learner/loss_tokens"] for h in orch.history] == [48] * 8
    assert [h["learner/version"] for h in orch.history] == list(range(1, 9))
    # generation overlapping the steps: what the asynchronous loop is for
    overlap = [h["throughput/gen_tokens_while_training"] for h in orch.history]
    assert min(overlap) >= 0 and (sum(overlap) > 0 or staleness == 0)
    # the bound holds when a response enters training; a split response's rest follows one step later
    assert max(h["staleness/async_max"] for h in orch.history) <= staleness
    assert max(h["staleness/max"] for h in orch.history) <= staleness + 1
    assert actor_versions == [8, 8]
    # mean penalty per step: in [-0.5, 0], and below 0 whenever a response ran out of tokens
    scored = [h for h in orch.history if h["reward/num_samples"]]  # a step can find the buffer full
    assert scored and all(-0.5 <= h["reward/no_eos_penalty"] <= 0 for h in scored)
    assert any(h["reward/no_eos_penalty"] < 0 for h in scored)
    assert any(h["reward/overlong_penalty"] < 0 for h in scored)
    t = orch.driver.ledger.token_accounting()
    assert t["in"] == t["out"] + t["dropped_stale"] + t["buffered"]


class RecordingOrchestrator(Orchestrator):
    """The real loop, recording every sample it ingests."""

    seen: list = []

    def _receive(self):
        samples = super()._receive()
        self.seen.extend((s.prompt_id, s.metadata["record_key"], s.temperature, s.sample_index,
                          len(s.response_ids)) for s in samples)
        return samples


def test_stages_switch_sampling_budget_and_filter_solved_prompts(ray_cluster, tmp_path, small_model):
    stages = ("[{steps: 3, max_tokens: 6, group_size: 4, token_budget: 32},"
              " {max_tokens: 8, group_size: 6, temperature: 0.5, token_budget: 40, online_filter: true}]")
    cfg = load_config(None, [
        f"model.path={small_model}", "rollout.engine=fake", "total_steps=6", f"stages={stages}",
        "buffer.max_staleness=0", "algo.drop_zero_variance_groups=false", "observe.console=off",
        # a stand-in verifier: prompts with an even record index are always solved
        "reward.type=import:asyncrl.reward.fault_injection:solves_even_records",
        "observe.tensorboard=false", f"observe.output_dir={tmp_path}", "save_final=false",
    ])
    orch = RecordingOrchestrator(cfg)
    orch.seen = []
    try:
        orch.run()
    finally:
        orch.shutdown()
    assert [h["stage/index"] for h in orch.history] == [0, 0, 0, 1, 1, 1]
    assert [h["learner/loss_tokens"] for h in orch.history] == [32] * 3 + [40] * 3
    first = [x for x in orch.seen if not x[0].startswith("s1-")]
    second = [x for x in orch.seen if x[0].startswith("s1-")]
    assert first and second
    assert all(t == 1.0 and i < 4 and n <= 6 for _, _, t, i, n in first)
    assert all(t == 0.5 and i < 6 and n <= 8 for _, _, t, i, n in second)
    solved_in_first = {key for _, key, *_ in first if int(key.rsplit("/", 1)[1]) % 2 == 0}
    assert orch.driver.stages.excluded and orch.driver.stages.excluded <= solved_in_first
    assert not {key for _, key, *_ in second} & orch.driver.stages.excluded  # filtered prompts never come back
    assert orch.history[-1]["data/prompts_filtered_total"] == len(orch.driver.stages.excluded)


class HangFirstGroup(Orchestrator):
    """The real loop, with the verifier told to hang on every sample of the first group."""

    def _receive(self):
        samples = super()._receive()
        for s in samples:
            self.hung_group = getattr(self, "hung_group", s.group_id)
            if s.group_id == self.hung_group:
                s.metadata = {**s.metadata, "behave": "hang"}
        return samples


def test_a_group_stuck_in_a_hung_verifier_does_not_hold_up_the_steps(ray_cluster, tmp_path, small_model):
    # Synchronous mode, the tightest bound: a step takes about B prompts of the current version, and
    # one of the first B hangs for the whole run. Counted against the bound it would starve the
    # buffer until the 120 s timeout; held by the verifiers it is replaced, and the steps go on.
    cfg = load_config(None, [
        f"model.path={small_model}", "rollout.engine=fake", "total_steps=6", "rollout.group_size=2",
        "buffer.token_budget=48", "buffer.max_staleness=0", "algo.drop_zero_variance_groups=false",
        "reward.type=import:asyncrl.reward.fault_injection:scripted", "reward.num_workers=4",
        "reward.timeout_s=120", "observe.console=off", "observe.tensorboard=false",
        f"observe.output_dir={tmp_path}", "save_final=false",
    ])
    orch = HangFirstGroup(cfg)
    try:
        orch.run()
        hung_pending = orch.driver.rewards.num_pending
    finally:
        orch.shutdown()
    assert [h["learner/loss_tokens"] for h in orch.history] == [48] * 6
    assert orch.driver.rewards.stats.timeouts == 0 and hung_pending >= 2  # still hanging when the run ended


def test_decoupled_rollout_batches_on_two_ranks_in_the_loop(ray_cluster, tmp_path, small_model):
    """Rollout batches of N_SGD = 2 (D_R 4, D_T 2) with decoupled PPO on two learner ranks: the
    orchestrator marks each batch's first step and hands the ranks their shares of the batch;
    the first step's ratio is 1 (pi_prox is the policy it starts from), the second's is not."""
    cfg = load_config(None, [
        f"model.path={small_model}", "rollout.engine=fake", "total_steps=4", "rollout.group_size=4",
        "buffer.rollout_batch_prompts=4", "buffer.minibatch_prompts=2", "buffer.max_staleness=0",
        "algo.decoupled=true", "learner.num_ranks=2", "learner.lr=1e-2", "algo.drop_zero_variance_groups=false",
        "algo.no_eos_penalty=0.5", "algo.overlong_buffer=4",  # rewards that vary: fake answers are all wrong
        "observe.console=off", "observe.tensorboard=false", f"observe.output_dir={tmp_path}", "save_final=false",
    ])
    orch = Orchestrator(cfg)
    try:
        orch.run()
    finally:
        orch.shutdown()
    rows = orch.history
    assert [r["learner/opens_rollout_batch"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    assert [r["buffer/rollout_batches_sealed_total"] for r in rows] == [1, 1, 2, 2]
    assert all(r["ratio/mean"] == pytest.approx(1.0, abs=1e-6) for r in rows[0::2])
    assert all(r["learner/grad_norm"] > 0 and abs(r["ratio/mean"] - 1.0) > 1e-4 for r in rows[1::2])


class ScoredIntake(Orchestrator):
    """The real loop, recording each ingested sample's record and the reward it arrived with."""

    def _receive(self):
        samples = super()._receive()
        self.seen.extend((s.metadata["record_key"], s.reward, s.reward_info.get("outcome")) for s in samples)
        return samples


def test_actors_that_score_their_own_samples_feed_the_loop_without_the_drivers_pool(ray_cluster, tmp_path, small_model):
    cfg = load_config(None, [
        f"model.path={small_model}", "rollout.engine=fake", "rollout.num_actors=2", "total_steps=4",
        "buffer.token_budget=48", "buffer.max_staleness=1", "eval.every_steps=0",
        "algo.drop_zero_variance_groups=false", "reward.placement=actor", "reward.num_workers=1",
        "reward.type=import:asyncrl.reward.fault_injection:solves_even_records",
        "observe.console=off", "observe.tensorboard=false", f"observe.output_dir={tmp_path}", "save_final=false",
    ])
    orch = ScoredIntake(cfg)
    orch.seen = []
    try:
        orch.run()
        actor_stats = orch.pool.stats()
    finally:
        orch.shutdown()
    assert [h["learner/loss_tokens"] for h in orch.history] == [48] * 4
    assert orch.seen and orch.driver.rewards.stats.submitted == 0  # nothing went through the driver's pool
    for key, reward, outcome in orch.seen:  # each scored by its actor, as the verifier scores its record
        assert (reward, outcome) == (float(int(key.rsplit("/", 1)[1]) % 2 == 0), "scripted")
    assert len(actor_stats) == 2 and sum(s["samples"] for s in actor_stats) >= len(orch.seen)
    assert orch.history[-1]["reward/actor_pool_timeouts_total"] == 0


def test_a_group_that_cannot_form_at_start_stops_the_run_with_the_timeout_to_raise(ray_cluster, tmp_path,
                                                                                   small_model, monkeypatch):
    """A component still busy with a one-time build (DeepSpeed's first op build on a loaded
    machine) kept the first weight-sync group from forming: a raw PushFailed traceback. The start
    waits sync.start_timeout_s, then stops with one message naming it (asyncrl run prints it)."""
    from asyncrl.orchestrator.weight_sync import PushFailed, WeightSync
    from asyncrl.types import RunFailed

    waited = []

    def never_forms(self, join_timeout_s=None):
        waited.append(join_timeout_s)
        raise PushFailed("weight-sync group at 10.0.0.1:29500 could not form: rollout actor 0 (timed out)", [0])

    monkeypatch.setattr(WeightSync, "rebuild_group", never_forms)
    cfg = load_config(None, [
        f"model.path={small_model}", "rollout.engine=fake", "total_steps=2", "sync.timeout_s=30",
        "sync.start_timeout_s=90", "observe.console=off", "observe.tensorboard=false",
        f"observe.output_dir={tmp_path}", "save_final=false"])
    orch = Orchestrator(cfg)
    try:
        with pytest.raises(RunFailed, match=r"rollout actor 0 \(timed out\) within sync.start_timeout_s=90s.*"
                                            r"raise sync.start_timeout_s"):
            orch.run()
    finally:
        orch.shutdown()
    assert waited == [90.0]


def test_distillation_routes_every_sample_through_the_teacher_engines_and_its_term_reaches_the_learner(
        ray_cluster, tmp_path, small_model):
    """algo.distill with fake engines, the real TeacherEngines under Ray: the fake teacher's logprob
    is log(1/16) for every token and a fake actor's is log(1/16) - 0.001 v for version v, so each
    token's teacher term is 0.001 v exactly. With reward "replace" the group advantages are 0 and
    the learner's mean advantage is that term alone: 0 on the first step (version 0 tokens only)
    and 0.001 x the mean version of the trained tokens after it."""
    cfg = load_config(None, [
        f"model.path={small_model}", "rollout.engine=fake", "total_steps=6", "buffer.token_budget=48",
        "buffer.max_staleness=1", f"algo.distill.teacher={small_model}", "algo.distill.reward=replace",
        "algo.distill.coef=2.0", "observe.console=off", "observe.tensorboard=false",
        f"observe.output_dir={tmp_path}", "save_final=false", "eval.every_steps=0"])
    orch = Orchestrator(cfg)
    try:
        orch.run()
        taught = orch.driver.intake.teacher.tally.total
    finally:
        orch.shutdown()
    rows = orch.history
    assert [h["learner/loss_tokens"] for h in rows] == [48] * 6
    assert rows[0]["advantage/token_mean"] == 0.0
    for h in rows[1:]:  # 2 * 0.001 * mean version, versions within the staleness bound of the step
        assert h["advantage/token_mean"] == pytest.approx(0.002 * (h["learner/version"] - 1 - h["staleness/mean"]),
                                                          abs=1e-6)
    assert any(h["advantage/token_mean"] > 0 for h in rows[1:])
    # the driver's side of the same term: log pi_b - log pi_teacher = -0.001 v per sampled token
    kl = [h["distill/reverse_kl"] for h in rows if h["distill/reverse_kl"] == h["distill/reverse_kl"]]
    assert kl and all(-0.001 * 6 - 1e-6 <= v <= 1e-7 for v in kl) and min(kl) < 0
    assert rows[-1]["distill/scored_total"] == taught >= orch.driver.ledger.counts.samples_received - rows[-1][
        "distill/pending"]


def test_a_teacher_engine_that_cannot_start_ends_the_run_with_its_reason_at_the_next_poll(ray_cluster, tmp_path):
    """A teacher whose model vLLM cannot load: the driver's next poll raises RunFailed naming the
    engine and the reason, before any sample was sent to it (nothing waits on a dead engine)."""
    import time

    from asyncrl.orchestrator.teacher_engines import TeacherEngines
    from asyncrl.types import RunFailed

    cfg = load_config(None, [f"algo.distill.teacher={tmp_path / 'missing'}", "model.max_model_len=64",
                             f"observe.output_dir={tmp_path}"])
    engines = TeacherEngines(cfg, say=lambda _: None)
    try:
        deadline = time.monotonic() + 120
        with pytest.raises(RunFailed, match=r"^teacher engine 0 \(.*missing.*\): the run cannot go on"):
            while time.monotonic() < deadline:
                assert engines.poll() == []
                time.sleep(0.2)
    finally:
        engines.close()


class KillingTeacherOrchestrator(Orchestrator):
    """The real loop, whose teacher engine's process is killed once, after the second step."""

    killed = False

    def _receive(self):
        if not self.killed and self.step >= 2:
            import ray

            ray.kill(self.driver.intake.teacher.actors[0])
            KillingTeacherOrchestrator.killed = True
        return super()._receive()


def test_a_teacher_engine_that_dies_is_replaced_and_no_sample_is_lost(ray_cluster, tmp_path, small_model):
    cfg = load_config(None, [
        f"model.path={small_model}", "rollout.engine=fake", "total_steps=6", "buffer.token_budget=48",
        f"algo.distill.teacher={small_model}", "observe.console=off", "observe.tensorboard=false",
        f"observe.output_dir={tmp_path}", "save_final=false", "eval.every_steps=0",
        "algo.drop_zero_variance_groups=false"])
    orch = KillingTeacherOrchestrator(cfg)
    try:
        orch.run()
        teacher = orch.driver.intake.teacher
        restarts, pending = teacher.restarts, teacher.num_pending
    finally:
        orch.shutdown()
    assert KillingTeacherOrchestrator.killed and restarts == 1
    assert orch.history[-1]["distill/teacher_restarts_total"] == 1.0
    assert [h["learner/loss_tokens"] for h in orch.history] == [48] * 6
    # every sample the ledger took in was scored by a teacher, or is still at one, or its group
    # was given up: none waits on the dead engine
    t = orch.driver.ledger.token_accounting()
    assert t["in"] == t["out"] + t["dropped_stale"] + t["buffered"]
    assert orch.history[-1]["distill/scored_total"] + pending >= sum(h["reward/num_samples"] for h in orch.history)


class StopAtFirstLook(Orchestrator):
    """The real loop, asked to stop (as a SIGTERM does) the first time it looks for samples."""

    def _receive(self):
        self.request_stop("SIGTERM")
        return super()._receive()


def _free_cpus_within(seconds: float) -> float:
    """The cluster's free CPUs once every process of a run has handed its own back (Ray frees a
    killed actor's a moment later)."""
    import time

    import ray

    deadline = time.monotonic() + seconds
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0)


def test_a_stop_while_the_actors_start_ends_the_start_and_one_before_the_first_step_saves_nothing(
        ray_cluster, tmp_path, small_model, monkeypatch):
    import json

    import ray

    from asyncrl.orchestrator.actor_pool import ActorPool
    from asyncrl.orchestrator.run_lock import previous_run
    from asyncrl.types import StartInterrupted

    def config(name):
        return load_config(None, [
            f"model.path={small_model}", "rollout.engine=fake", "total_steps=4", "checkpoint.every_steps=2",
            "observe.console=off", "observe.tensorboard=false", f"observe.output_dir={tmp_path}",
            "save_final=false", f"name={name}"])

    def events(orch):
        return [json.loads(x) for x in (orch.run_dir / "events.jsonl").read_text().splitlines()]

    cpus = ray.cluster_resources()["CPU"]
    spawn = ActorPool.spawn
    starting = Orchestrator(config("starting"))

    def spawn_then_stop(pool, num_actors):  # the signal comes while the actors' engines start
        spawn(pool, num_actors)
        starting.request_stop("SIGTERM")

    monkeypatch.setattr(ActorPool, "spawn", spawn_then_stop)
    try:
        with pytest.raises(StartInterrupted, match="^SIGTERM during start-up$"):
            starting.run()
    finally:
        starting.shutdown()
    monkeypatch.undo()
    # every process it spawned is gone (their CPUs are back), its end said so, and nothing holds
    # the directory against the same command
    assert _free_cpus_within(10) == cpus
    assert [(e["event"], e["status"], e["reason"]) for e in events(starting)] == [
        ("end", "interrupted", "SIGTERM during start-up")]
    assert previous_run(starting.run_dir) is None

    stopped = StopAtFirstLook(config("first"))
    try:
        summary = stopped.run()
    finally:
        stopped.shutdown()
    assert summary == {"steps": 0, "stopped": "SIGTERM"} and stopped.history == []
    # nothing was trained, so nothing was saved: resume=auto starts it over, as it was
    assert not (stopped.run_dir / "checkpoints").exists() or not any((stopped.run_dir / "checkpoints").iterdir())
    assert [e["event"] for e in events(stopped)] == ["start", "end"] and events(stopped)[-1]["status"] == "interrupted"
    assert _free_cpus_within(10) == cpus
