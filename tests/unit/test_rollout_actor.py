import asyncio

import pytest

from asyncrl.rollout.actor import RolloutActor
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.fake_engine import FakeEngine
from asyncrl.types import PromptItem


def run(coro):
    return asyncio.run(coro)


def make_actor(emitted, delay_s=0.002, sync_mode="drain", vocab_size=16, keep_kv=False):
    return RolloutActor(0, lambda: FakeEngine(vocab_size=vocab_size, delay_s=delay_s), SamplingSpec(1.0, 1.0, 8),
                        group_size=4, emit=emitted.append, seed=1, sync_mode=sync_mode, keep_kv=keep_kv)


def test_every_sample_of_every_prompt_is_emitted_once_with_consistent_fields():
    async def main():
        out = []
        actor = make_actor(out)
        await actor.start()
        await actor.submit([PromptItem(f"p{i}", [1, 2, 3], {"answer": str(i)}) for i in range(5)])
        while len(out) < 20:
            await asyncio.sleep(0.01)
        return out, actor

    out, actor = run(main())
    keys = sorted((s.group_id, s.sample_index) for s in out)
    assert keys == sorted((f"p{i}", j) for i in range(5) for j in range(4))
    for s in out:
        s.validate()
        assert s.versions == [0] * len(s.response_ids)
        assert s.metadata["answer"] == s.group_id[1:]
    assert actor.stats["samples"] == 20


def test_drain_update_waits_for_in_flight_requests_and_tags_later_tokens():
    async def main():
        out = []
        actor = make_actor(out, delay_s=0.01)
        await actor.start()
        await actor.submit([PromptItem("early", [1], {})])
        await asyncio.sleep(0.005)  # requests are running
        update = asyncio.create_task(actor.update_weights({}, version=1))
        await asyncio.sleep(0)
        await actor.submit([PromptItem("late", [1], {})])  # queued behind the closed gate
        stats = await update
        n_at_update = len(out)
        while len(out) < 8:
            await asyncio.sleep(0.01)
        return out, n_at_update, actor, stats

    out, n_at_update, actor, stats = run(main())
    assert n_at_update == 4  # every early request finished before the load
    assert all(s.versions == [0] * len(s.versions) for s in out if s.group_id == "early")
    assert all(s.versions == [1] * len(s.versions) for s in out if s.group_id == "late")
    assert actor.engine.loaded_versions == [1] and actor.version == 1
    assert stats["sync/pause_s"] >= 0 and stats["sync/aborted_requests"] == 0


def test_a_push_may_repeat_the_version_but_never_go_back():
    # a repeat is how survivors take part in the push that brings a new actor up to date
    async def main():
        actor = make_actor([])
        await actor.start()
        await actor.update_weights({}, 2)
        await actor.update_weights({}, 2)
        try:
            await actor.update_weights({}, 1)
        except ValueError as e:
            return actor.engine.loaded_versions, str(e)

    loaded, error = run(main())
    assert loaded == [2, 2] and "version 1 after 2" in error


def test_a_rewind_push_goes_back_to_a_checkpoints_version():
    async def main():  # the learner restarted from an older checkpoint: the actors follow it
        actor = make_actor([])
        await actor.start()
        await actor.update_weights({}, 5)
        await actor.update_weights({}, 3, rewind=True)
        return actor.engine.loaded_versions, actor.version

    assert run(main()) == ([5, 3], 3)


def test_a_failed_load_keeps_new_requests_waiting_until_a_push_succeeds():
    async def main():
        out = []
        actor = make_actor(out)
        await actor.start()
        real_load = actor.engine.load_weights

        async def broken(metadata, version):
            raise RuntimeError("peer went away")

        actor.engine.load_weights = broken
        try:
            await actor.update_weights({}, 1)
        except RuntimeError:
            pass
        await actor.submit([PromptItem("late", [1, 2], {})])
        await asyncio.sleep(0.05)
        held = len(out)  # nothing generated with a half-loaded model
        actor.engine.load_weights = real_load
        await actor.update_weights({}, 1)
        while len(out) < actor.group_size:
            await asyncio.sleep(0.01)
        return held, {v for s in out for v in s.versions}

    held, versions = run(main())
    assert held == 0 and versions == {1}


def test_inflight_update_aborts_and_resumes_with_each_token_tagged_by_the_weights_that_sampled_it():
    # vocab 1000 with eos 0: responses run to max_tokens (8), about 40 ms each at 10 ms a token
    async def main():
        out = []
        actor = make_actor(out, delay_s=0.01, sync_mode="inflight", vocab_size=1000)
        await actor.start()
        await actor.submit([PromptItem("early", [1, 2], {})])
        await asyncio.sleep(0.015)  # every request has some tokens and not all of them
        stats = await actor.update_weights({}, version=1)  # the fake engine refuses a load while requests run
        n_at_update = len(out)
        while len(out) < 4:
            await asyncio.sleep(0.01)
        return out, n_at_update, actor, stats

    out, n_at_update, actor, stats = run(main())
    engine = actor.engine
    assert n_at_update == 0 and stats["sync/aborted_requests"] == 4
    assert stats["sync/pause_s"] < 0.03  # not the ~40 ms a drain would wait
    for s in out:
        s.validate()
        assert len(s.response_ids) == 8 and s.finish_reason == "length"
        k = s.versions.index(1)  # versions step from 0 to 1 once, inside the response
        assert 0 < k < 8 and s.versions == [0] * k + [1] * (8 - k)
        assert s.logprobs == [engine.logprob_at(v) for v in s.versions]
    assert actor.stats["resumed"] == 4


def test_inflight_resume_continues_from_the_prefix_and_keeps_the_prompt():
    prompts = []

    async def main():
        out = []
        actor = make_actor(out, delay_s=0.01, sync_mode="inflight", vocab_size=1000)
        await actor.start()
        real = actor.engine.generate

        async def recording(prompt_ids, spec, request_id):
            prompts.append((request_id, list(prompt_ids), spec.max_tokens))
            return await real(prompt_ids, spec, request_id)

        actor.engine.generate = recording
        await actor.submit([PromptItem("p", [7, 8], {})])
        await asyncio.sleep(0.015)
        await actor.update_weights({}, version=1)
        while len(out) < 4:
            await asyncio.sleep(0.01)
        return out

    out = run(main())
    first = {rid: (ids, n) for rid, ids, n in prompts if "-r" not in rid}
    resumed = {rid: (ids, n) for rid, ids, n in prompts if rid.endswith("-r1")}
    assert len(first) == 4 and len(resumed) == 4 and all(n == 8 for _, n in first.values())
    for s in out:
        rid = f"p-{s.sample_index}-a0"
        k = s.versions.count(0)
        ids, n = resumed[rid + "-r1"]
        assert s.prompt_ids == [7, 8] and ids == [7, 8] + s.response_ids[:k] and n == 8 - k


@pytest.mark.parametrize("keep_kv", [False, True])
def test_an_inflight_update_lets_evaluation_requests_finish_on_one_version(keep_kv):
    """Neither aborted nor kept across the load: a push waits for evaluation requests."""
    async def main():
        actor = make_actor([], delay_s=0.01, sync_mode="inflight", vocab_size=1000, keep_kv=keep_kv)
        await actor.start()
        evaluation = asyncio.create_task(actor.evaluate([PromptItem("eval-0", [1], {})], SamplingSpec(1.0, 1.0, 8), n=2))
        await asyncio.sleep(0.015)
        stats = await actor.update_weights({}, version=1)
        return await evaluation, stats

    samples, stats = run(main())
    assert stats["sync/aborted_requests"] == 0 and stats["sync/kept_requests"] == 0
    assert all(s.versions == [0] * 8 for s in samples)


def test_keep_kv_pauses_requests_in_place_and_tags_each_token_by_the_weights_that_sampled_it():
    """sync.keep_kv: no request is aborted or resumed (one engine request a sample, never a
    prefix prefilled again); the tokens after the load carry its version, from the engine's labels."""
    requests = []

    async def main():
        out = []
        actor = make_actor(out, delay_s=0.01, sync_mode="inflight", vocab_size=1000, keep_kv=True)
        await actor.start()
        real = actor.engine.generate

        async def recording(prompt_ids, spec, request_id):
            requests.append(request_id)
            return await real(prompt_ids, spec, request_id)

        actor.engine.generate = recording
        await actor.submit([PromptItem("p", [7, 8], {})])
        await asyncio.sleep(0.015)  # every request has some tokens and not all of them
        stats = await actor.update_weights({}, version=1)  # the fake engine refuses a load unless paused
        while len(out) < 4:
            await asyncio.sleep(0.01)
        return out, stats, actor

    out, stats, actor = run(main())
    assert stats["sync/aborted_requests"] == 0 and stats["sync/kept_requests"] == 4
    assert sorted(requests) == [f"p-{i}-a0" for i in range(4)] and actor.stats["resumed"] == 0
    for s in out:
        s.validate()
        assert len(s.response_ids) == 8
        k = s.versions.index(1)
        assert 0 < k < 8 and s.versions == [0] * k + [1] * (8 - k)
        assert s.logprobs == [actor.engine.logprob_at(v) for v in s.versions]


def test_token_versions_of_a_kept_request():
    from asyncrl.rollout.actor import token_versions

    assert token_versions(None, 3, 4) == [3, 3, 3, 3]
    # the first stretch is the start's whatever its label (none before a labelled load, or a
    # previous run's in a warm study); later stretches are the loads' own versions
    assert token_versions([None, None, 4, 4, 5], 3, 5) == [3, 3, 4, 4, 5]
    assert token_versions([300, 300, 1], 0, 3) == [0, 0, 1]
    try:
        make_actor([], sync_mode="drain", keep_kv=True)
    except ValueError as e:
        assert "inflight" in str(e)
    else:
        raise AssertionError("keep_kv with drain must be refused")


def test_occupancy_is_requests_running_over_the_engines_batch_since_the_last_update():
    """4 requests run from the submit until the drain before the load ends them (vocab 1000: 8
    tokens of ~5 ms each): an engine of max_num_seqs 2 is full but for the last request's tail,
    one of 8 at most half full (4 of 8), less as the requests end one by one."""
    async def main(max_num_seqs):
        actor = RolloutActor(0, lambda: FakeEngine(vocab_size=1000, delay_s=0.01, max_num_seqs=max_num_seqs),
                             SamplingSpec(1.0, 1.0, 8), group_size=4, emit=lambda s: None, sync_mode="drain")
        await actor.start()
        await actor.update_weights({}, version=1)  # the window starts here: nothing ran before
        await actor.submit([PromptItem("p", [1], {})])
        await asyncio.sleep(0.025)
        return (await actor.update_weights({}, version=2))["rollout/occupancy"]

    full, half = run(main(2)), run(main(8))
    assert full > 0.7 and 0.25 < half <= 0.5 and half < full


@pytest.mark.parametrize("keep_kv", [False, True], ids=["abort", "keep_kv"])
def test_weights_that_failed_their_checksum_generate_nothing_until_the_whole_push_that_follows(keep_kv):
    """The engine reports sync/verify_failures: the actor stays closed (with keep_kv, its requests
    stay paused) and the next load of the same version opens it; no token carries the bad load."""
    async def main():
        out = []
        actor = make_actor(out, delay_s=0.01, sync_mode="inflight", vocab_size=1000, keep_kv=keep_kv)
        await actor.start()
        real, reports = actor.engine.load_weights, [1, 0]

        async def checked(metadata, version):
            return {**await real(metadata, version), "sync/verify_failures": reports.pop(0)}

        actor.engine.load_weights = checked
        await actor.submit([PromptItem("p", [7, 8], {})])
        await asyncio.sleep(0.015)
        refused = await actor.update_weights({}, version=1)
        emitted = len(out)
        await asyncio.sleep(0.1)  # ten tokens' time: a running or new request would have advanced
        held = len(out) == emitted and not actor._gate.is_set()
        healed = await actor.update_weights({}, version=1)
        while len(out) < 4:
            await asyncio.sleep(0.01)
        return out, refused, healed, held

    out, refused, healed, held = run(main())
    assert refused["sync/verify_failures"] == 1 and healed["sync/verify_failures"] == 0 and held
    assert healed["sync/aborted_requests"] == 0 and healed["sync/kept_requests"] == 0  # nothing ran in between
    for s in out:
        k = s.versions.index(1) if 1 in s.versions else len(s.versions)
        assert s.versions == [0] * k + [1] * (len(s.versions) - k)


class SlowStartEngine(FakeEngine):
    """An engine whose start waits until told: what the actor does meanwhile can be seen."""

    def __init__(self, started: asyncio.Event, fail: bool = False):
        super().__init__(vocab_size=16, delay_s=0.002)
        self.started, self.fail = started, fail

    async def start(self):
        await asyncio.wait_for(self.started.wait(), 5)
        if self.fail:
            raise RuntimeError("the engine could not start")
        await super().start()


class RecordingScorer:
    """A scorer that gives every sample reward 1.0 and sends it on at once."""

    def __init__(self, emit):
        self.emit, self.closed = emit, False

    def submit(self, sample):
        sample.reward = 1.0
        self.emit(sample)

    async def deliver(self):
        await asyncio.Event().wait()

    def close(self):
        self.closed = True


def test_the_scorer_is_built_while_the_engine_starts_and_scores_what_it_sends():
    async def main():
        out, built, started = [], [], asyncio.Event()

        def scorer(emit):
            built.append(RecordingScorer(emit))
            started.set()  # the engine's start goes on only once the scorer exists
            return built[-1]

        actor = RolloutActor(0, lambda: SlowStartEngine(started), SamplingSpec(1.0, 1.0, 8), group_size=2,
                             emit=out.append, scorer=scorer)
        await actor.start()
        await actor.submit([PromptItem("p", [1, 2], {})])
        while len(out) < 2:
            await asyncio.sleep(0.01)
        return out, built

    out, built = run(main())
    assert len(built) == 1 and [s.reward for s in out] == [1.0, 1.0]


def test_an_engine_that_cannot_start_closes_the_scorer_built_meanwhile():
    async def main():
        built, started = [], asyncio.Event()

        def scorer(emit):
            built.append(RecordingScorer(emit))
            started.set()
            return built[-1]

        actor = RolloutActor(0, lambda: SlowStartEngine(started, fail=True), SamplingSpec(1.0, 1.0, 8),
                             group_size=2, emit=[].append, scorer=scorer)
        with pytest.raises(RuntimeError, match="could not start"):
            await actor.start()
        return built

    [scorer] = run(main())
    assert scorer.closed
