import random

import pytest

from asyncrl.buffer.group_assembler import GroupAssembler, Rejected
from asyncrl.buffer.token_buffer import TokenBuffer
from asyncrl.types import Group, Sample, ScoredSample


def make_sample(gid, i, n_tokens, version=0, prompt_len=3):
    return Sample(prompt_id=gid, group_id=gid, sample_index=i, prompt_ids=list(range(1, prompt_len + 1)),
                  response_ids=[100 + j for j in range(n_tokens)], logprobs=[-0.1 * (j + 1) for j in range(n_tokens)],
                  versions=[version] * n_tokens, finish_reason="stop", actor_id=0)


def make_group(gid, lengths, version=0, advantages=None):
    samples = [ScoredSample(make_sample(gid, i, n, version), reward=float(i % 2)) for i, n in enumerate(lengths)]
    return Group(gid, samples, advantages or [float(i) for i in range(len(lengths))])


def test_every_batch_has_exactly_the_budget():
    buf = TokenBuffer(token_budget=10, max_staleness=5)
    buf.add_group(make_group("g0", [4, 7, 5]))  # 16 tokens
    batch = buf.next_batch(0)
    assert sum(c.num_loss_tokens for c in batch) == 10
    assert buf.num_loss_tokens == 6
    assert buf.next_batch(0) is None  # 6 < 10: no partial batch
    buf.add_group(make_group("g1", [4]))
    assert sum(c.num_loss_tokens for c in buf.next_batch(0)) == 10
    assert buf.num_loss_tokens == 0


def test_split_response_continues_at_head_of_next_batch_with_context():
    buf = TokenBuffer(token_budget=6, max_staleness=5)
    buf.add_group(make_group("g", [4, 5], advantages=[1.5, -0.5]))
    first = buf.next_batch(0)
    assert [(c.sample_index, c.loss_start, c.loss_end) for c in first] == [(0, 0, 4), (1, 0, 2)]
    buf.add_group(make_group("h", [10]))
    second = buf.next_batch(0)
    head = second[0]
    # the rest of response 1: its first two tokens are context only, loss on tokens 2..4
    assert (head.group_id, head.sample_index, head.loss_start, head.loss_end) == ("g", 1, 2, 5)
    assert head.response_ids == [100, 101, 102, 103, 104]
    assert head.old_logprobs == pytest.approx([-0.3, -0.4, -0.5])
    assert head.advantage == -0.5
    assert sum(c.num_loss_tokens for c in second) == 6
    assert buf.stats.responses_split >= 1


def test_a_late_group_of_an_older_version_is_trained_before_fresher_tokens():
    # its rewards waited out a verifier timeout: behind the fresh group it would be stale by step 3
    buf = TokenBuffer(token_budget=4, max_staleness=1)
    buf.add_group(make_group("fresh", [4], version=2))
    buf.add_group(make_group("late", [4], version=1))
    order = [c.group_id for c in buf.next_batch(2)] + [c.group_id for c in buf.next_batch(3)]
    assert order == ["late", "fresh"] and buf.stats.tokens_dropped_stale == 0
    # equal versions keep arrival order
    for gid in ("a", "b", "c"):
        buf.add_group(make_group(gid, [4], version=3))
    assert [buf.next_batch(3)[0].group_id for _ in range(3)] == ["a", "b", "c"]


def test_a_split_response_keeps_the_head_when_an_older_group_arrives():
    buf = TokenBuffer(token_budget=6, max_staleness=5)
    buf.add_group(make_group("g", [4, 5], version=1))
    buf.next_batch(1)  # g/0 whole and 2 tokens of g/1
    buf.add_group(make_group("old", [3, 4], version=0))
    second = buf.next_batch(1)
    assert [(c.group_id, c.sample_index, c.loss_start, c.loss_end) for c in second] == [
        ("g", 1, 2, 5), ("old", 0, 0, 3)]


def test_out_of_order_arrivals_queue_by_version_then_arrival_behind_a_split_head():
    """The queue order the buffer's bisection keeps equals a stable sort by first version, the
    split head (its rest opens the next batch) staying first: checked over random arrivals and cuts."""
    rng = random.Random(3)
    buf = TokenBuffer(token_budget=7, max_staleness=100)
    arrived = []  # (version, arrival) of every response still queued, as the reference keeps them
    for k in range(300):
        version = rng.randrange(6)
        buf.add_group(make_group(f"g{k}", [rng.randrange(1, 5)], version=version))
        arrived.append((version, k))
        if rng.random() < 0.3 and buf.num_loss_tokens >= 7:
            buf.next_batch(10)
        queue = list(buf._queue)
        head_split = queue[0].offset > 0
        rest = queue[1:] if head_split else queue
        live = {p.sample.group_id for p in queue}
        expected = sorted((va for va in arrived if f"g{va[1]}" in live and (not head_split or
                          f"g{va[1]}" != queue[0].sample.group_id)))
        assert [p.sample.group_id for p in rest] == [f"g{k}" for _, k in expected]


def test_no_token_lost_or_duplicated_over_many_batches():
    rng = random.Random(0)
    budget = 37
    buf = TokenBuffer(token_budget=budget, max_staleness=100)
    added = {}
    for g in range(300):
        lengths = [rng.randint(0, 20) for _ in range(4)]
        buf.add_group(make_group(f"g{g}", lengths))
        for i, n in enumerate(lengths):
            for j in range(n):
                added[(f"g{g}", i, j)] = 0
    trained = {}
    while (batch := buf.next_batch(0)) is not None:
        assert sum(c.num_loss_tokens for c in batch) == budget
        for c in batch:
            for j in range(c.loss_start, c.loss_end):
                key = (c.group_id, c.sample_index, j)
                assert key not in trained, f"token {key} trained twice"
                trained[key] = 1
    leftover = buf.num_loss_tokens
    assert len(trained) + leftover == len(added)
    assert len(trained) == buf.stats.tokens_out
    assert buf.stats.tokens_in == buf.stats.tokens_out + buf.stats.tokens_dropped_stale + leftover
    assert leftover < budget


def test_stale_tokens_are_never_trained_and_are_counted():
    buf = TokenBuffer(token_budget=4, max_staleness=1)
    buf.add_group(make_group("old", [3], version=0))
    buf.add_group(make_group("new", [5], version=2))
    batch = buf.next_batch(learner_version=2)  # version 0 lags by 2 > 1
    assert [c.group_id for c in batch] == ["new"]
    assert buf.stats.tokens_dropped_stale == 3
    for c in batch:
        assert all(2 - v <= 1 for v in c.versions)


def test_stale_policy_train_trains_stale_tokens_and_counts_them_beyond_the_bound():
    """`train`: eta bounds admission only; a response 2 versions behind is trained whole, and the
    cut reports its tokens beyond the bound (staleness/* then say what that costs)."""
    buf = TokenBuffer(token_budget=8, max_staleness=1, stale_policy="train")
    buf.add_group(make_group("old", [3], version=0))
    buf.add_group(make_group("new", [5], version=2))
    batch = buf.next_batch(learner_version=2)
    assert [(c.group_id, c.versions) for c in batch] == [("old", [0, 0, 0]), ("new", [2] * 5)]
    assert buf.stats.tokens_dropped_stale == 0 and buf.stats.tokens_beyond_bound == 3
    assert buf.stats.tokens_in == buf.stats.tokens_out == 8


def test_mixed_version_response_keeps_only_its_fresh_suffix():
    buf = TokenBuffer(token_budget=2, max_staleness=0)
    s = make_sample("g", 0, 4)
    s.versions = [0, 0, 1, 1]
    buf.add_group(Group("g", [ScoredSample(s, 1.0)], [1.0]))
    (chunk,) = buf.next_batch(learner_version=1)
    assert (chunk.loss_start, chunk.loss_end, chunk.versions) == (2, 4, [1, 1])
    assert buf.stats.tokens_dropped_stale == 2


def test_empty_responses_are_counted_not_queued():
    buf = TokenBuffer(token_budget=2, max_staleness=1)
    buf.add_group(make_group("g", [0, 2]))
    assert buf.num_responses == 1 and buf.stats.responses_empty == 1


def assemble(asm, gid, rewards, truncated=None):
    """The group of `rewards` (response i truncated where `truncated[i]`): its advantages if kept,
    None if rejected."""
    samples = []
    for i, r in enumerate(rewards):
        s = make_sample(gid, i, 3)
        s.finish_reason = "length" if truncated and truncated[i] else "stop"
        samples.append(ScoredSample(s, reward=r))
    out = asm.assemble(gid, samples)
    if isinstance(out, Rejected):
        assert out.group_id == gid and out.num_samples == len(rewards)
        return None
    assert out.group.group_id == gid and [m.reward for m in out.group.samples] == rewards
    return out.group.advantages


def test_assembler_drops_zero_variance_groups_and_counts_them():
    asm = GroupAssembler()
    assert assemble(asm, "same", [1.0, 1.0, 1.0]) is None
    assert asm.stats.groups_zero_variance == 1 and asm.stats.samples_zero_variance == 3
    out = assemble(asm, "mixed", [1.0, 0.0, 0.0])
    # population std of (1,0,0) = sqrt(2)/3; mean 1/3
    std = (2 ** 0.5) / 3
    assert out == pytest.approx([(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)])
    assert asm.stats.groups_complete == 2


def test_assembler_masks_truncated_responses_after_the_group_statistics():
    # rewards (1, 0, 0, 1), response 3 truncated; "after": GRPO over all four, then 0 for it
    asm = GroupAssembler(eps=0.0, truncation_mask="after")
    assert assemble(asm, "g", [1.0, 0.0, 0.0, 1.0], [False, False, False, True]) == pytest.approx([1.0, -1.0, -1.0, 0.0])


def test_rejection_sampling_keeps_a_group_only_if_an_advantage_survives_the_truncation_mask():
    """Skywork-OR1 section 3.1: a group is kept when some A_ij != 0 after the mask, not when its raw
    rewards differ. (0, 1, 1, 1) with response 0 truncated: "before" computes the advantages of
    the three kept rewards (all 1, so 0) and zeroes response 0: no signal, dropped. "after" with
    every response truncated: all zero, dropped. (0, 0, 1, 1) with 0 and 1 truncated, "after":
    mean 1/2, population std 1/2, so the kept responses get +1: kept."""
    before = GroupAssembler(truncation_mask="before")
    assert assemble(before, "b", [0.0, 1.0, 1.0, 1.0], [True, False, False, False]) is None
    assert before.stats.groups_zero_variance == 1 and before.stats.samples_zero_variance == 4
    after = GroupAssembler(eps=0.0, truncation_mask="after")
    assert assemble(after, "a", [1.0, 0.0, 0.0, 0.0], [True] * 4) is None
    kept = assemble(after, "k", [0.0, 0.0, 1.0, 1.0], [True, True, False, False])
    assert kept == [0.0, 0.0, 1.0, 1.0]
    assert after.stats.groups_zero_variance == 1 and after.stats.groups_complete == 2
    # the switch off keeps the signal-less group (its advantages are all 0)
    keep_all = GroupAssembler(truncation_mask="before", drop_zero_variance=False)
    assert assemble(keep_all, "z", [0.0, 1.0, 1.0, 1.0], [True, False, False, False]) == [0.0] * 4


def test_assembler_rloo_advantages():
    # r_i - mean of the other two
    assert assemble(GroupAssembler(advantage="rloo"), "g", [1.0, 0.0, 0.5]) == pytest.approx(
        [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5])


def test_stale_scan_stops_at_the_first_young_response_and_drops_exactly_the_old_tokens():
    """The queue past its head is in version order, so the scan may stop early; a split head
    that is newer than the responses behind it must not stop it."""
    buf = TokenBuffer(token_budget=3, max_staleness=1)
    buf.add_group(make_group("v2", [4], version=2))
    buf.next_batch(2)  # "v2" is split: its last token stays at the head
    mixed = make_sample("mix", 0, 4, version=0)
    mixed.versions = [0, 0, 1, 3]  # versions never decrease along a response
    for g in (Group("mix", [ScoredSample(mixed, 1.0)], [1.0]), make_group("v0", [2], version=0),
              make_group("v1", [3], version=1), make_group("v3", [5], version=3)):
        buf.add_group(g)
    assert buf.drop_stale(2) == 2 + 2  # mix's two version-0 tokens and all of v0; v1 is the first kept
    assert buf.num_loss_tokens == 1 + 2 + 3 + 5
    assert buf.stats.tokens_in == buf.stats.tokens_out + buf.stats.tokens_dropped_stale + buf.num_loss_tokens
    assert [c.group_id for c in buf.next_batch(2)] == ["v2", "mix"]


def test_the_rest_of_a_split_response_is_trained_not_dropped_as_stale():
    """Ring-lite's recipe (max_staleness 0): a response cut at the Phi boundary has its rest
    trained one version later; judging that rest again would train the prefix and drop the ending
    (EOS, the answer). Every token is trained exactly once."""
    buf = TokenBuffer(token_budget=4, max_staleness=0)
    buf.add_group(make_group("a", [6], version=0))
    first = buf.next_batch(0)
    assert [(c.loss_start, c.loss_end) for c in first] == [(0, 4)]
    buf.add_group(make_group("b", [2], version=1))
    second = buf.next_batch(1)
    assert [(c.group_id, c.loss_start, c.loss_end) for c in second] == [("a", 4, 6), ("b", 0, 2)]
    assert [c.entered_at for c in second] == [0, 1]  # the rest keeps the version it entered at
    assert buf.stats.tokens_dropped_stale == 0
    assert buf.stats.tokens_out == 8 == buf.stats.tokens_in


def test_a_response_not_yet_trained_is_still_judged_at_the_head():
    buf = TokenBuffer(token_budget=4, max_staleness=0)
    buf.add_group(make_group("a", [3], version=0))
    buf.add_group(make_group("b", [4], version=1))
    (chunk,) = buf.next_batch(1)  # "a" never entered training: stale at version 1
    assert (chunk.group_id, buf.stats.tokens_dropped_stale) == ("b", 3)


def test_whole_cut_takes_whole_responses_until_the_budget_is_reached():
    buf = TokenBuffer(token_budget=5, max_staleness=1, cut="whole")
    buf.add_group(make_group("g", [3, 4, 2]))
    batch = buf.next_batch(0)
    assert [(c.sample_index, c.loss_start, c.loss_end) for c in batch] == [(0, 0, 3), (1, 0, 4)]  # 7 >= 5
    assert buf.num_loss_tokens == 2 and buf.stats.responses_split == 0
    assert buf.next_batch(0) is None  # 2 < 5
    buf.add_group(make_group("h", [3]))
    assert [c.num_loss_tokens for c in buf.next_batch(0)] == [2, 3]
    assert buf.stats.tokens_out == buf.stats.tokens_in == 12
    with pytest.raises(ValueError, match="unknown cut"):
        TokenBuffer(4, 0, cut="halves")


def test_length_bias_compares_what_was_trained_with_what_came_in():
    # responses of 2 and 6 tokens come in (mean 4); the 6-token one (version 0) is dropped as stale,
    # the 2-token one trained: trained mean 2, bias 2 / 4 - 1 = -0.5
    buf = TokenBuffer(token_budget=2, max_staleness=0)
    buf.add_group(make_group("long", [6], version=0))
    buf.add_group(make_group("short", [2], version=1))
    assert buf.stats.length_bias == 0.0  # nothing trained yet
    buf.next_batch(1)
    assert buf.stats.length_bias == pytest.approx(2 / 4 - 1)
    # a split response counts by the share of it trained: 4 + 2 tokens of a 6-token response over
    # two steps is one response of 6; with the 2-token one: (2 + 6) / 2 = 4 = the mean in, bias 0
    fair = TokenBuffer(token_budget=4, max_staleness=5)
    fair.add_group(make_group("g", [6, 2]))
    fair.next_batch(0)
    fair.next_batch(0)
    assert fair.stats.responses_trained == pytest.approx(2.0)
    assert fair.stats.length_bias == pytest.approx(0.0)
