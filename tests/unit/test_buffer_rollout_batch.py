import random
from collections import Counter

import pytest

from asyncrl.algo.schedule import num_sgd_steps
from asyncrl.buffer.rollout_batch import RolloutBatchBuffer
from asyncrl.types import Group, Sample, ScoredSample


def make_sample(gid, i, versions, prompt_len=3, temperature=1.0):
    n = len(versions)
    return Sample(prompt_id=gid, group_id=gid, sample_index=i, prompt_ids=list(range(1, prompt_len + 1)),
                  response_ids=[100 + j for j in range(n)], logprobs=[-0.1 * (j + 1) for j in range(n)],
                  versions=list(versions), finish_reason="stop", actor_id=0, temperature=temperature)


def make_group(gid, lengths, version=0, advantages=None, temperature=1.0):
    """lengths: one int per response (all tokens at `version`) or an explicit list of versions."""
    versions = [[version] * n if isinstance(n, int) else n for n in lengths]
    samples = [ScoredSample(make_sample(gid, i, v, temperature=temperature), reward=float(i % 2))
               for i, v in enumerate(versions)]
    return Group(gid, samples, advantages or [float(i) - 0.5 for i in range(len(lengths))])


def spans(batch):
    return [(c.group_id, c.sample_index, c.loss_start, c.loss_end) for c in batch]


def pass_order(seed, batch_index, pass_index, n):
    order = list(range(n))
    random.Random(f"{seed}/{batch_index}/{pass_index}").shuffle(order)
    return order


def assert_accounting(buf):
    s = buf.stats
    assert buf.num_reuse * (s.tokens_in - s.tokens_dropped_stale) == s.tokens_out + buf.num_loss_tokens


def drain(buf, version=0):
    out = []
    while (batch := buf.next_batch(version)) is not None:
        out.append(batch)
        assert_accounting(buf)
    return out


def test_prompt_mode_takes_n_sgd_steps_of_whole_responses():
    buf = RolloutBatchBuffer(token_budget=8, max_staleness=0, rollout_batch_prompts=4, minibatch_prompts=2,
                             num_reuse=3, seed=7)
    lengths = {"g0": [3, 1], "g1": [2], "g2": [5, 4, 1], "g3": [6]}
    for gid, ls in lengths.items():
        buf.add_group(make_group(gid, ls))
    steps = drain(buf)
    assert len(steps) == num_sgd_steps(4, 2, 3) == 6
    assert buf.stats.batches_out == 6 and buf.stats.rollout_batches_sealed == 1
    for p in range(3):
        order = pass_order(7, 0, p, 4)
        for k in range(2):
            gids = [f"g{i}" for i in sorted(order[2 * k:2 * k + 2])]
            expected = [(g, i, 0, n) for g in gids for i, n in enumerate(lengths[g])]
            assert spans(steps[2 * p + k]) == expected
    assert buf.stats.tokens_out == 3 * 22 and buf.num_loss_tokens == 0
    assert_accounting(buf)


def test_one_minibatch_one_pass_is_plain_on_policy_prompt_order():
    buf = RolloutBatchBuffer(token_budget=4, max_staleness=0, rollout_batch_prompts=3, minibatch_prompts=3,
                             seed=123)
    for g in range(6):
        buf.add_group(make_group(f"g{g}", [g + 1, 2]))
    steps = drain(buf)
    assert [spans(b) for b in steps] == [
        [(f"g{g}", i, 0, n) for g in gids for i, n in enumerate([g + 1, 2])] for gids in ([0, 1, 2], [3, 4, 5])]
    first = steps[0][0]
    assert first.response_ids == [100] and first.prompt_ids == [1, 2, 3]
    assert first.old_logprobs == pytest.approx([-0.1]) and first.versions == [0] and first.advantage == -0.5


def test_token_mode_steps_hold_exactly_phi_and_the_tail_opens_the_next_rollout_batch():
    buf = RolloutBatchBuffer(token_budget=10, max_staleness=0, rollout_batch_prompts=2, num_reuse=2)
    buf.add_group(make_group("a", [4, 3]))
    assert buf.next_batch(0) is None  # one group of two: nothing sealed yet
    assert buf.stats.rollout_batches_sealed == 0 and buf.num_loss_tokens == 2 * 7
    buf.add_group(make_group("b", [5]))
    assert [pass_order(0, 0, p, 2) for p in range(2)] == [[0, 1], [1, 0]]  # stream: a0 a1 b0 | b0 a0 a1
    first, second = buf.next_batch(0), buf.next_batch(0)
    assert spans(first) == [("a", 0, 0, 4), ("a", 1, 0, 3), ("b", 0, 0, 3)]
    # pass 0's end and pass 1's start meet in one step: b0 appears twice, from different passes
    assert spans(second) == [("b", 0, 3, 5), ("b", 0, 0, 5), ("a", 0, 0, 3)]
    assert buf.next_batch(0) is None and buf.num_loss_tokens == 4  # 24 planned, 4 carried
    buf.add_group(make_group("c", [6]))
    buf.add_group(make_group("d", [2]))
    nxt = buf.next_batch(0)
    # the carried tail opens the new rollout batch's first step, earlier tokens as context
    assert spans(nxt)[:2] == [("a", 0, 3, 4), ("a", 1, 0, 3)]
    assert nxt[0].response_ids == [100, 101, 102, 103] and nxt[0].old_logprobs == pytest.approx([-0.4])
    assert sum(c.num_loss_tokens for c in nxt) == 10 and buf.stats.rollout_batches_sealed == 2
    assert sum(c.num_loss_tokens for c in buf.next_batch(0)) == 10
    assert buf.next_batch(0) is None and buf.num_loss_tokens == 0
    assert buf.stats.tokens_out == 40 == 2 * buf.stats.tokens_in
    assert_accounting(buf)


def test_take_opening_marks_the_first_step_of_each_rollout_batch_and_hands_over_its_responses():
    """Token mode, D_R = 2 groups, N_reuse = 2: the first step of a batch is "open" with every kept
    response once over its kept tokens (a stale prefix is not part of it); the later steps
    "continue"; the step that carries the previous batch's tail opens the next."""
    buf = RolloutBatchBuffer(token_budget=10, max_staleness=1, rollout_batch_prompts=2, num_reuse=2)
    buf.add_group(make_group("a", [4, [0, 1, 2]], version=1))  # a1's first token is stale at version 2
    buf.add_group(make_group("b", [5], version=2))
    assert buf.next_batch(2) is not None
    role, opened = buf.take_opening()
    assert role == "open" and spans(opened) == [("a", 0, 0, 4), ("a", 1, 1, 3), ("b", 0, 0, 5)]
    assert opened[1].old_logprobs == pytest.approx([-0.2, -0.3]) and opened[1].versions == [1, 2]
    assert buf.next_batch(2) is not None and buf.take_opening() == ("continue", [])
    buf.add_group(make_group("c", [6], version=2))
    buf.add_group(make_group("d", [2], version=2))
    assert buf.next_batch(3) is not None
    role, opened = buf.take_opening()
    assert role == "open" and spans(opened) == [("c", 0, 0, 6), ("d", 0, 0, 2)]
    # prompt mode: N_SGD = 2 opens and continues; N_SGD = 1, every step is its own batch
    for d_t, reuse, roles in ((1, 1, ["open", "continue"]), (2, 1, ["own"])):
        buf = RolloutBatchBuffer(token_budget=8, max_staleness=0, rollout_batch_prompts=2, minibatch_prompts=d_t,
                                 num_reuse=reuse)
        buf.add_group(make_group("a", [3]))
        buf.add_group(make_group("b", [2]))
        got = []
        while buf.next_batch(0) is not None:
            got.append(buf.take_opening()[0])
        assert got == roles


def test_token_budget_change_takes_effect_on_the_next_step():
    buf = RolloutBatchBuffer(token_budget=5, max_staleness=0, rollout_batch_prompts=1)
    buf.add_group(make_group("g", [12]))
    assert sum(c.num_loss_tokens for c in buf.next_batch(0)) == 5
    buf.token_budget = 7
    assert spans(buf.next_batch(0)) == [("g", 0, 5, 12)]
    buf.token_budget = 1
    assert buf.next_batch(0) is None  # nothing left, nothing to seal
    buf.add_group(make_group("h", [3]))
    assert [sum(c.num_loss_tokens for c in b) for b in drain(buf)] == [1, 1, 1]


def test_a_rollout_batch_is_not_sealed_while_the_previous_one_can_fill_a_step():
    buf = RolloutBatchBuffer(token_budget=3, max_staleness=0, rollout_batch_prompts=2, minibatch_prompts=1)
    for g in range(5):
        buf.add_group(make_group(f"g{g}", [2]))
    gids = []
    for sealed in (1, 1, 2, 2):
        gids.append(buf.next_batch(0)[0].group_id)
        assert buf.stats.rollout_batches_sealed == sealed
    # sealed in arrival order, exactly D_R groups each; g4 keeps collecting
    assert sorted(gids[:2]) == ["g0", "g1"] and sorted(gids[2:]) == ["g2", "g3"]
    assert buf.next_batch(0) is None and buf.num_loss_tokens == 2
    tok = RolloutBatchBuffer(token_budget=3, max_staleness=0, rollout_batch_prompts=1)
    tok.add_group(make_group("a", [7]))
    tok.add_group(make_group("b", [7]))
    tok.next_batch(0)
    tok.next_batch(0)
    assert tok.stats.rollout_batches_sealed == 1  # 1 token left < 3: the next call seals "b"
    assert spans(tok.next_batch(0)) == [("a", 0, 6, 7), ("b", 0, 0, 2)]
    assert tok.stats.rollout_batches_sealed == 2


def test_staleness_is_checked_once_at_sealing_and_counted_once():
    buf = RolloutBatchBuffer(token_budget=4, max_staleness=1, rollout_batch_prompts=2, minibatch_prompts=2,
                             num_reuse=2)
    buf.add_group(make_group("g", [[0, 0, 1, 2, 2], [3, 3]]))
    buf.add_group(make_group("h", [[0, 1]]))
    assert buf.num_loss_tokens == 2 * 9
    first = buf.next_batch(learner_version=3)  # oldest kept version: 3 - 1 = 2
    assert spans(first) == [("g", 0, 3, 5), ("g", 1, 0, 2)]
    assert first[0].versions == [2, 2] and first[0].response_ids == [100, 101, 102, 103, 104]
    assert first[0].old_logprobs == pytest.approx([-0.4, -0.5])
    assert buf.stats.tokens_dropped_stale == 3 + 2 and buf.stats.responses_all_stale == 1
    # the reuse pass runs far behind the learner: off-policy on purpose, nothing dropped
    assert spans(buf.next_batch(learner_version=100)) == spans(first)
    assert buf.stats.tokens_dropped_stale == 5 and buf.stats.tokens_out == 8
    assert_accounting(buf)


def test_staleness_uses_the_learner_version_at_sealing_not_at_arrival():
    buf = RolloutBatchBuffer(token_budget=2, max_staleness=1, rollout_batch_prompts=1)
    buf.add_group(make_group("g", [[0, 1, 2, 3]]))
    assert buf.stats.tokens_dropped_stale == 0
    assert spans(buf.next_batch(learner_version=3)) == [("g", 0, 2, 4)]
    assert buf.stats.tokens_dropped_stale == 2


def test_empty_and_all_stale_responses_and_minibatches_are_skipped():
    buf = RolloutBatchBuffer(token_budget=2, max_staleness=0, rollout_batch_prompts=4, minibatch_prompts=1)
    buf.add_group(make_group("a", [0, 2], version=1))
    buf.add_group(make_group("b", [0], version=1))
    buf.add_group(make_group("c", [[0, 0]]))
    buf.add_group(make_group("d", [[1], [0, 1, 1]]))
    steps = drain(buf, version=1)
    # b is empty and c all stale: their mini-batches are skipped, 2 steps instead of 4
    assert sorted(spans(b) for b in steps) == [[("a", 1, 0, 2)], [("d", 0, 0, 1), ("d", 1, 1, 3)]]
    s = buf.stats
    assert (s.responses_in, s.responses_empty, s.responses_all_stale) == (6, 2, 1)
    assert s.minibatches_skipped == 2 and s.batches_out == 2 < num_sgd_steps(4, 1)
    assert (s.tokens_in, s.tokens_dropped_stale, s.tokens_out) == (8, 3, 5)
    assert_accounting(buf)


def test_same_seed_same_batches_other_seed_other_order():
    def run(seed):
        buf = RolloutBatchBuffer(token_budget=6, max_staleness=0, rollout_batch_prompts=8, num_reuse=2, seed=seed)
        for g in range(8):
            buf.add_group(make_group(f"g{g}", [g % 3 + 1, 2]))
        return [spans(b) for b in drain(buf)]
    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize("args", [dict(rollout_batch_prompts=6, minibatch_prompts=4),
                                  dict(rollout_batch_prompts=0), dict(rollout_batch_prompts=4, num_reuse=0),
                                  dict(rollout_batch_prompts=4, token_budget=0)])
def test_invalid_schedules_are_rejected(args):
    with pytest.raises(ValueError):
        RolloutBatchBuffer(**{"token_budget": 8, "max_staleness": 1, **args})


def check_chunks(batch, groups):
    for c in batch:
        s = groups[int(c.group_id[1:])].samples[c.sample_index].sample
        assert c.response_ids == s.response_ids[:c.loss_end] and c.prompt_ids == s.prompt_ids
        assert c.versions == s.versions[c.loss_start:c.loss_end] and c.num_loss_tokens > 0
        assert c.old_logprobs == s.logprobs[c.loss_start:c.loss_end]
        assert c.advantage == groups[int(c.group_id[1:])].advantages[c.sample_index]
        assert c.temperature == s.temperature


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("d_r,d_t,reuse", [(1, 1, 1), (4, 2, 2), (3, 1, 3), (6, 3, 1), (6, 6, 2), (2, None, 1),
                                           (3, None, 2), (5, None, 3)])
def test_random_streams_emit_every_kept_token_num_reuse_times(seed, d_r, d_t, reuse):
    rng = random.Random(seed * 100 + d_r * 10 + reuse)
    max_staleness = rng.randint(0, 2)
    buf = RolloutBatchBuffer(token_budget=rng.randint(1, 30), max_staleness=max_staleness,
                             rollout_batch_prompts=d_r, minibatch_prompts=d_t, num_reuse=reuse, seed=seed)
    groups, sealed_at, steps = [], [], []  # steps: the emitted (gid, index, position) of each step
    version = 0

    def step():
        if d_t is None and rng.random() < 0.2:
            buf.token_budget = rng.randint(1, 30)
        before = buf.stats.rollout_batches_sealed
        batch = buf.next_batch(version)
        sealed_at.extend([version] * (buf.stats.rollout_batches_sealed - before))
        assert_accounting(buf)
        if batch is None:
            return False
        check_chunks(batch, groups)
        if d_t is None:
            assert sum(c.num_loss_tokens for c in batch) == buf.token_budget
        steps.append([(c.group_id, c.sample_index, j) for c in batch for j in range(c.loss_start, c.loss_end)])
        return True

    for g in range(rng.randint(2, 6) * d_r + rng.randint(0, d_r - 1)):
        versions = []  # non-decreasing along each response, some lagging the learner
        for _ in range(rng.randint(1, 3)):
            v, vs = version - rng.randint(0, 3), []
            for _ in range(rng.choice([0, rng.randint(1, 12)])):
                v += rng.random() < 0.2
                vs.append(v)
            versions.append(vs)
        groups.append(make_group(f"g{g}", versions, advantages=[rng.uniform(-1, 1) for _ in versions],
                                 temperature=rng.choice([0.6, 1.0])))
        buf.add_group(groups[-1])
        for _ in range(rng.randint(0, 3)):
            version += step() * rng.randint(0, 2)
    while step():
        pass
    assert len(sealed_at) == len(groups) // d_r  # drained: every full rollout batch is sealed

    # each sealed batch's kept tokens, recomputed from the learner version at its sealing
    kept_by_batch, dropped = [], 0
    for b, v in enumerate(sealed_at):
        kept = []
        for grp in groups[b * d_r:(b + 1) * d_r]:
            for m in grp.samples:
                s = m.sample
                stale = 0
                while stale < len(s.versions) and v - s.versions[stale] > max_staleness:
                    stale += 1
                dropped += stale
                kept += [(s.group_id, s.sample_index, j) for j in range(stale, len(s.versions))]
        kept_by_batch.append(kept)
    assert buf.stats.tokens_dropped_stale == dropped

    # emission order: N_reuse passes per batch, batch after batch, each pass every kept token once
    tokens = [t for s in steps for t in s]
    pos = 0
    for kept in kept_by_batch:
        for _ in range(reuse):
            got = tokens[pos:pos + len(kept)]
            assert len(set(got)) == len(got) and set(got) <= set(kept)
            if pos + len(kept) <= len(tokens):
                assert len(got) == len(kept)
            pos += len(kept)
    assert pos >= len(tokens)  # nothing emitted beyond the sealed passes (a short last pass is the held tail)
    counts = Counter(tokens)
    assert all(0 < n <= reuse for n in counts.values())
    collecting = sum(len(m.sample.response_ids) for grp in groups[len(sealed_at) * d_r:] for m in grp.samples)
    held = buf.num_loss_tokens - reuse * collecting
    assert reuse * sum(map(len, kept_by_batch)) == len(tokens) + held == buf.stats.tokens_out + held
    if d_t is None:
        assert held < buf.token_budget
        return
    assert held == 0 and all(counts[t] == reuse for kept in kept_by_batch for t in kept)
    assert len(steps) == num_sgd_steps(d_r, d_t, reuse) * len(sealed_at) - buf.stats.minibatches_skipped
    for s in steps:  # a step: whole responses of at most D_T groups of one rollout batch
        gids = {int(g[1:]) for g, _, _ in s}
        assert len(gids) <= d_t and len({g // d_r for g in gids}) == 1


def test_batch_start_version_is_the_version_a_batch_was_sealed_at_and_survives_a_checkpoint():
    buf = RolloutBatchBuffer(token_budget=4, max_staleness=9, rollout_batch_prompts=1, minibatch_prompts=1,
                             num_reuse=2)
    assert buf.batch_start_version is None  # nothing sealed yet
    buf.add_group(make_group("g0", [2], version=1))
    buf.add_group(make_group("g1", [2], version=2))
    assert buf.next_batch(3) is not None and buf.batch_start_version == 3
    assert buf.next_batch(4) is not None and buf.batch_start_version == 3  # the second pass: reuse
    restored = RolloutBatchBuffer(token_budget=4, max_staleness=9, rollout_batch_prompts=1, minibatch_prompts=1,
                                  num_reuse=2)
    restored.load_state_dict(buf.state_dict())
    assert restored.batch_start_version == 3
    assert restored.next_batch(5) is not None and restored.batch_start_version == 5  # g1's batch
