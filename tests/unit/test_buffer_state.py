"""Buffers saved mid-run (a split response, collecting groups, planned passes) and loaded into a
fresh buffer emit exactly the batches the original goes on to emit."""

import random

import msgpack

from asyncrl.buffer.rollout_batch import RolloutBatchBuffer
from asyncrl.buffer.token_buffer import TokenBuffer
from asyncrl.types import Group, Sample, ScoredSample


def group(gid, lengths, version):
    rng = random.Random(gid)
    samples = [ScoredSample(Sample(gid, gid, i, [1, 2], [rng.randrange(50) for _ in range(n)],
                                   [rng.uniform(-3, 0) for _ in range(n)], [version] * n, "stop", 0),
                            reward=float(i % 2), reward_info={"outcome": "verified"})
               for i, n in enumerate(lengths)]
    return Group(gid, samples, [rng.uniform(-1, 1) for _ in lengths])


def through_msgpack(state):
    return msgpack.unpackb(msgpack.packb(state, use_bin_type=True), raw=False, strict_map_key=False)


def drain(buf, version, steps):
    return [buf.next_batch(version + k) for k in range(steps)]


def test_token_buffer_round_trip_keeps_the_split_response_at_the_head():
    buf = TokenBuffer(7, max_staleness=2)
    buf.add_group(group("a", [4, 5, 3], version=0))
    buf.add_group(group("b", [6, 2], version=1))
    first = buf.next_batch(1)
    assert first[-1].loss_end < len(first[-1].response_ids) or buf.stats.responses_split
    fresh = TokenBuffer(7, max_staleness=2)
    fresh.load_state_dict(through_msgpack(buf.state_dict()))
    assert fresh.num_loss_tokens == buf.num_loss_tokens and fresh.stats == buf.stats
    assert drain(fresh, 2, 2) == drain(buf, 2, 2)
    assert fresh.stats == buf.stats


def test_rollout_batch_buffer_round_trip_in_both_modes():
    for minibatch in (None, 2):
        buf = RolloutBatchBuffer(6, max_staleness=1, rollout_batch_prompts=4, minibatch_prompts=minibatch,
                                 num_reuse=2, seed=3)
        for i in range(6):
            buf.add_group(group(f"g{i}", [3, 4], version=0), seq=i)
        buf.next_batch(1)  # seals the first 4, two are still collecting
        fresh = RolloutBatchBuffer(6, max_staleness=1, rollout_batch_prompts=4, minibatch_prompts=minibatch,
                                   num_reuse=2, seed=3)
        fresh.load_state_dict(through_msgpack(buf.state_dict()))
        assert fresh.num_loss_tokens == buf.num_loss_tokens and fresh.steps_left == buf.steps_left
        for i in (6, 7):
            for b in (buf, fresh):
                b.add_group(group(f"g{i}", [3, 4], version=1), seq=i)
        assert drain(fresh, 1, 6) == drain(buf, 1, 6)
        assert fresh.stats == buf.stats


def test_a_state_of_one_buffer_kind_does_not_load_into_the_other():
    state = TokenBuffer(4, 0).state_dict()
    try:
        RolloutBatchBuffer(4, 0, rollout_batch_prompts=2).load_state_dict(state)
    except ValueError as e:
        assert "token" in str(e)
    else:
        raise AssertionError("loaded a token buffer's state into a rollout-batch buffer")
