"""The group ledger without Ray: admission bound, group life, requeue on actor loss, accounting
that balances, and a state round trip that keeps the staleness bound exact."""

import msgpack

from asyncrl.buffer.group_assembler import GroupAssembler
from asyncrl.buffer.rollout_batch import RolloutBatchBuffer
from asyncrl.buffer.token_buffer import TokenBuffer
from asyncrl.orchestrator.ledger import GroupLedger, Shaping
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.types import PromptItem, Sample

SPEC = SamplingSpec(1.0, 1.0, 8)


def make_ledger(buffer=None, n=2, workers=2):
    return GroupLedger(buffer or TokenBuffer(16, max_staleness=1), GroupAssembler(), Shaping(), workers)


def prompt(i):
    return PromptItem(f"p{i}", [1, 2, 3], {"answer": "1", "record_key": f"d/{i}"})


def sample(gid, index, length=4, version=0):
    return Sample(gid, gid, index, [1, 2, 3], list(range(5, 5 + length)), [-0.5] * length, [version] * length,
                  "stop", actor_id=0)


def balanced(ledger):
    a = ledger.accounting()
    return a["received"] == a["kept"] + a["rejected"] + a["discarded"] + a["orphaned"] + a["live"]


def test_a_group_moves_from_generating_to_scoring_to_the_buffer():
    led = make_ledger()
    rec = led.admit(prompt(0), 0, SPEC, 2, actor=0, version=0)
    assert rec.state == "generating" and led.generating_by_actor([0, 1]) == {0: 1, 1: 0}
    for i in range(2):
        assert led.on_generated(sample("p0", i)) is rec
    assert rec.state == "scoring" and led.generating_by_actor([0]) == {0: 0}
    led.on_scored(sample("p0", 0), 1.0, {})
    assert "p0" in led.records and led.buffer.num_loss_tokens == 0
    led.on_scored(sample("p0", 1), 0.0, {})
    assert "p0" not in led.records and led.buffer.num_loss_tokens == 8
    assert led.counts.groups_kept == 1 and led.counts.kept_group_tokens == 8
    assert balanced(led)


def test_zero_variance_groups_are_rejected_and_counted():
    led = make_ledger()
    led.admit(prompt(0), 0, SPEC, 2, actor=0, version=0)
    for i in range(2):
        led.on_generated(sample("p0", i))
        led.on_scored(sample("p0", i), 1.0, {})
    assert led.counts.groups_rejected == 1 and led.counts.samples_rejected == 2 and led.buffer.num_loss_tokens == 0
    assert balanced(led)


def test_shaping_uses_the_max_tokens_the_group_was_admitted_with():
    led = GroupLedger(TokenBuffer(16, 1), GroupAssembler(), Shaping(overlong_buffer=4), 2)
    led.admit(prompt(0), 0, SamplingSpec(1.0, 1.0, 8), 2, actor=0, version=0)
    info = {}
    led.on_generated(sample("p0", 0, length=8))
    led.on_scored(sample("p0", 0, length=8), 1.0, info)
    # DAPO: length 8 at max 8 with a buffer of 4 is past the ramp's end: penalty -1 * factor 1
    assert info["shaping"]["reward/overlong_penalty"] == -1.0


def test_repeats_and_unknown_groups_are_orphans_and_never_scored():
    led = make_ledger()
    led.admit(prompt(0), 0, SPEC, 2, actor=0, version=0)
    assert led.on_generated(sample("p0", 0)) is not None
    assert led.on_generated(sample("p0", 0)) is None  # a resent frame
    assert led.on_generated(sample("p0", 5)) is None  # an index the group does not have
    assert led.on_generated(sample("nobody", 0)) is None
    assert led.counts.samples_orphaned == 3 and balanced(led)


def test_an_actor_lost_requeues_its_generating_groups_under_new_ids():
    led = make_ledger()
    led.admit(prompt(0), 0, SPEC, 2, actor=0, version=0)
    led.admit(prompt(1), 0, SPEC, 2, actor=1, version=0)
    led.admit(prompt(2), 0, SPEC, 2, actor=0, version=0)
    led.on_generated(sample("p0", 0))
    led.on_scored(sample("p0", 0), 1.0, {})
    for i in range(2):  # p2 is fully generated: it only waits for rewards, which do not need actor 0
        led.on_generated(sample("p2", i))
    assert led.requeue_actor(0) == 1
    assert set(led.records) == {"p1", "p2"} and led.counts.samples_discarded == 1
    [again] = led.take_requeued(5)
    assert again.prompt.prompt_id == "p0.r1" and again.prompt.metadata["record_key"] == "d/0"
    led.readmit(again, actor=1, version=0)
    # the old attempt's reward comes back late: ignored, not trained
    assert led.on_scored(sample("p0", 1), 0.0, {}) is None
    assert led.on_generated(sample("p0", 1)) is None  # its late sample: an orphan
    for i in range(2):
        led.on_generated(sample("p0.r1", i))
        led.on_scored(sample("p0.r1", i), float(i), {})
    assert led.counts.groups_kept == 1 and balanced(led)
    led.requeue_actor(1)
    assert led.take_requeued(5)[0].prompt.prompt_id == "p1.r1" and balanced(led)


def test_capacity_is_the_same_after_a_state_round_trip_and_in_flight_groups_are_regenerated():
    led = make_ledger(TokenBuffer(16, max_staleness=1))
    for i in range(6):
        led.admit(prompt(i), 0, SPEC, 2, actor=0, version=0)
    for gid in ("p0", "p1"):
        for i in range(2):
            led.on_generated(sample(gid, i))
            led.on_scored(sample(gid, i), float(i), {})
    led.on_generated(sample("p2", 0))
    before = led.capacity(3, 16, 2, 8, step_running=False, verifiers_behind=False)
    # through msgpack, as a checkpoint stores it
    state = msgpack.unpackb(msgpack.packb(led.state_dict(), use_bin_type=True), raw=False, strict_map_key=False)
    fresh = make_ledger(TokenBuffer(16, max_staleness=1))
    fresh.load_state_dict(state)
    assert [r.prompt.prompt_id for r in fresh.requeued] == ["p2", "p3", "p4", "p5"]  # same ids: nothing in flight
    assert fresh.counts.samples_discarded == 1 and balanced(fresh)
    assert fresh.buffer.num_loss_tokens == led.buffer.num_loss_tokens == 16
    # requeued groups are not running yet: readmitting them is what restores the same bound
    for r in fresh.take_requeued(4):
        fresh.readmit(r, actor=0, version=0)
    assert fresh.capacity(3, 16, 2, 8, step_running=False, verifiers_behind=False) == before
    # (eta + v + 1) * B - (kept + live): B = 16 / 8 = 2 -> (1 + 3 + 1) * 2 - (2 + 4) = 4
    assert before == 4


def test_rollout_batches_are_sealed_in_admission_order_whatever_the_arrival_order():
    def run(order):
        buf = RolloutBatchBuffer(8, max_staleness=0, rollout_batch_prompts=3, minibatch_prompts=3)
        led = make_ledger(buf)
        for i in range(3):
            led.admit(prompt(i), 0, SPEC, 2, actor=0, version=0)
        for gid in order:
            for i in range(2):
                led.on_generated(sample(gid, i))
                led.on_scored(sample(gid, i), float(i), {})
        return [c.group_id for c in buf.next_batch(0)]

    assert run(["p2", "p0", "p1"]) == run(["p0", "p1", "p2"]) == ["p0", "p0", "p1", "p1", "p2", "p2"]


def test_generating_counts_kept_as_groups_move_equal_a_scan_of_the_records():
    """Admission reads per-actor generating counts (and the stale gate the oldest admission
    versions) every loop turn; they are kept up to date as groups are admitted, complete, get
    scored, or are requeued, and must equal a full scan."""
    import random

    rng = random.Random(7)
    led = make_ledger(TokenBuffer(10_000, max_staleness=100), n=3)
    actors, next_prompt = [0, 1, 2], 0

    def scanned():
        load = dict.fromkeys(actors, 0)
        for r in led.records.values():
            if r.state == "generating" and r.actor in load:
                load[r.actor] += 1
        return load

    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            led.admit(prompt(next_prompt), 0, SPEC, 3, actor=rng.choice(actors), version=rng.randrange(4))
            next_prompt += 1
        elif op < 0.75 and led.records:
            rec = rng.choice(list(led.records.values()))
            missing = [i for i in range(3) if i not in rec.versions]
            if missing:
                led.on_generated(sample(rec.group_id, rng.choice(missing)))
            elif rec.scored < 3:
                led.on_scored(sample(rec.group_id, rec.scored), float(rng.random() < 0.5), {})
        elif op < 0.8:
            led.requeue_actor(rng.choice(actors))
        elif led.requeued:
            for r in led.take_requeued(2):
                led.readmit(r, rng.choice(actors), version=rng.randrange(4))
        assert led.generating_by_actor(actors) == scanned()
        # samples still to arrive per actor (admission by requests), against a scan of the records
        assert led.requests_by_actor(actors) == {a: sum(3 - r.generated for r in led.records.values()
                                                        if r.actor == a and r.state == "generating") for a in actors}
        # the admission versions the stale gate reads, likewise
        live = led.records.values()
        assert led.in_flight_versions.oldest == min((r.admitted_at for r in live), default=None)
        assert led.generating_versions.oldest == min((r.admitted_at for r in live if r.state == "generating"),
                                                     default=None)
        assert sum(led.generating_by_actor(actors).values()) == sum(r.state == "generating" for r in led.records.values())
    assert balanced(led)


def test_a_reward_that_comes_back_twice_is_ignored_and_counted():
    """A group's scored samples live on its record: the second reward for one sample changes
    nothing (the group is not completed early, nothing is trained twice)."""
    led = make_ledger()
    rec = led.admit(prompt(0), 0, SPEC, 2, actor=0, version=0)
    for i in range(2):
        led.on_generated(sample("p0", i))
    assert led.on_scored(sample("p0", 0), 1.0, {}) is rec
    assert led.on_scored(sample("p0", 0), 0.0, {}) is None
    assert rec.state == "scoring" and rec.scored == 1 and rec.samples[0].reward == 1.0
    assert led.counts.samples_duplicate == 1 and led.token_metrics()["buffer/duplicate_samples_total"] == 1
    led.on_scored(sample("p0", 1), 0.0, {})
    assert rec.state == "kept" and rec.samples == {} and led.buffer.num_loss_tokens == 8
    assert balanced(led)


def test_the_train_loop_takes_step_batches_from_the_ledger():
    """The consumer side: a StepBatch with the buffer's Phi, and a stage's new Phi from then on."""
    led = make_ledger(TokenBuffer(6, max_staleness=1))
    led.admit(prompt(0), 0, SPEC, 2, actor=0, version=0)
    for i in range(2):
        led.on_generated(sample("p0", i))
        led.on_scored(sample("p0", i), float(i), {})
    batch = led.next_batch(0)
    assert (sum(c.num_loss_tokens for c in batch.chunks), batch.role, batch.opened, batch.start_version,
            batch.token_budget) == (6, "own", [], None, 6)
    assert led.next_batch(0) is None  # 2 tokens left, Phi 6
    led.set_token_budget(2)
    assert led.next_batch(0).token_budget == 2
    assert led.token_accounting() == {"in": 8, "out": 8, "dropped_stale": 0, "buffered": 0}


def test_admission_versions_survive_a_state_round_trip():
    """The learner version each group was admitted at (buffer.stale_policy wait and pace read the
    oldest) is checkpointed with its requeued record, and set anew when it is readmitted."""
    led = make_ledger()
    led.admit(prompt(0), 0, SPEC, 2, actor=0, version=3)
    led.admit(prompt(1), 0, SPEC, 2, actor=0, version=5)
    for i in range(2):
        led.on_generated(sample("p0", i))  # p0 is scoring, p1 generating
    assert (led.in_flight_versions.oldest, led.generating_versions.oldest) == (3, 5)
    state = msgpack.unpackb(msgpack.packb(led.state_dict(), use_bin_type=True), raw=False, strict_map_key=False)
    fresh = make_ledger()
    fresh.load_state_dict(state)
    assert [r.admitted_at for r in fresh.requeued] == [3, 5] and fresh.in_flight_versions.oldest is None
    [again] = fresh.take_requeued(1)
    fresh.readmit(again, actor=0, version=7)
    assert again.admitted_at == fresh.in_flight_versions.oldest == fresh.generating_versions.oldest == 7
    for record in state["requeued"]:  # a checkpoint from before admission versions
        del record["admitted_at"]
    older = make_ledger()
    older.load_state_dict(state)
    assert [r.admitted_at for r in older.requeued] == [0, 0]


def test_a_learner_restart_renews_the_checkpoints_requeued_ids_so_the_kept_actors_old_samples_are_orphans():
    led = make_ledger()
    led.admit(prompt(0), 0, SPEC, 2, actor=0, version=0)
    led.on_generated(sample("p0", 0))
    state = msgpack.unpackb(msgpack.packb(led.state_dict()), strict_map_key=False)  # the checkpoint
    led.on_generated(sample("p0", 1))  # the run goes on past it, then the learner dies
    led.load_state_dict(state)
    led.renew_requeued()
    [again] = led.take_requeued(5)
    assert again.prompt.prompt_id == "p0.r1" and again.prompt.metadata["record_key"] == "d/0"
    led.readmit(again, actor=0, version=0)
    # the kept actor still delivers its old attempt: orphaned, never joins the regenerated group
    assert led.on_generated(sample("p0", 1)) is None and led.counts.samples_orphaned == 1
    for i in range(2):
        assert led.on_generated(sample("p0.r1", i)) is not None
        led.on_scored(sample("p0.r1", i), float(i), {})
    assert led.counts.groups_kept == 1 and balanced(led)


def test_a_group_moves_only_along_its_lifecycle():
    """`_move` is the one place a state changes: a move the lifecycle has no arrow for is refused
    (here: requeueing a group already in the buffer, admitting one twice), and nothing changes."""
    import pytest

    from asyncrl.orchestrator.ledger import GroupState

    led = make_ledger()
    rec = led.admit(prompt(0), 0, SPEC, 2, actor=0, version=0)
    for i in range(2):
        led.on_generated(sample("p0", i))
        led.on_scored(sample("p0", i), float(i), {})
    assert rec.state is GroupState.KEPT
    before = (dict(led.counts.__dict__), len(led.requeued), led.generating_by_actor([0]))
    with pytest.raises(ValueError, match="no move from kept to requeued"):
        led._move(rec, GroupState.REQUEUED)
    with pytest.raises(ValueError, match="no move from kept to generating"):
        led.readmit(rec, 1, version=1)
    assert (dict(led.counts.__dict__), len(led.requeued), led.generating_by_actor([0])) == before
    assert rec.state is GroupState.KEPT and rec.actor == 0 and balanced(led)
