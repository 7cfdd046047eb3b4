"""A rollout actor that scores its own samples (reward.placement: actor), with the real reward
pool: each sample leaves once, carrying the verifier's reward, and a hung verifier costs its
sample reward 0 (outcome timeout), not the actor's stream."""

import asyncio
import time

from asyncrl.config import RewardConfig
from asyncrl.rollout.actor import RolloutActor
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.fake_engine import FakeEngine
from asyncrl.rollout.local_rewards import LocalRewards
from asyncrl.tiny.tokenizer import save_tokenizer
from asyncrl.types import PromptItem


def test_each_sample_leaves_once_scored_beside_the_engine_and_a_hang_costs_only_its_reward(tmp_path):
    save_tokenizer(tmp_path)
    cfg = RewardConfig(type="import:asyncrl.reward.fault_injection:scripted", num_workers=2, timeout_s=1.0)
    rewards = {"p0": 0.25, "p1": 0.5, "p2": 1.0}

    async def main():
        out = []
        actor = RolloutActor(0, lambda: FakeEngine(vocab_size=16, delay_s=0.002), SamplingSpec(1.0, 1.0, 8),
                             group_size=4, emit=out.append, seed=1,
                             scorer=lambda emit: LocalRewards.build(cfg, str(tmp_path), emit))
        await actor.start()
        actor._scorer.pool.wait_ready()
        t0 = time.monotonic()
        await actor.submit([PromptItem(p, [1, 2, 3], {"reward": r}) for p, r in rewards.items()]
                           + [PromptItem("hangs", [1, 2, 3], {"behave": "hang"})])
        while len(out) < 16 and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.01)
        stats = actor.get_stats()
        t1 = time.monotonic()
        await actor.shutdown()
        return out, stats, time.monotonic() - t1

    out, stats, shutdown_s = asyncio.run(main())
    assert sorted((s.group_id, s.sample_index) for s in out) == sorted(
        (g, i) for g in [*rewards, "hangs"] for i in range(4))
    for s in out:
        s.validate()
        if s.group_id == "hangs":
            assert (s.reward, s.reward_info["outcome"]) == (0.0, "timeout") and s.reward_latency_s >= 1.0
        else:
            assert (s.reward, s.reward_info["outcome"]) == (rewards[s.group_id], "scripted")
            assert 0 <= s.reward_latency_s < 1.0
    assert stats["samples"] == 16 and stats["scoring"] == 0
    assert shutdown_s < 10
