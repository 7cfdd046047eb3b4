import asyncio

from asyncrl.rollout.actor import RolloutActor
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.fake_engine import FakeEngine
from asyncrl.types import PromptItem


def run(coro):
    return asyncio.run(coro)


def make_actor(emitted, delay_s=0.002):
    return RolloutActor(0, lambda: FakeEngine(vocab_size=16, delay_s=delay_s), SamplingSpec(1.0, 1.0, 8),
                        group_size=4, emit=emitted.append, seed=1)


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
    assert stats["sync/drain_s"] >= 0


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
