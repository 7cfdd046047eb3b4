from asyncrl.buffer.packing import split_for_ranks
from asyncrl.learner.micro_batches import micro_batches
from asyncrl.buffer.admission import admission_capacity, rollout_batch_capacity
from asyncrl.orchestrator.admission import assign_prompts, prompts_per_step
from asyncrl.types import SequenceChunk


def test_capacity_follows_the_staleness_formula():
    # (eta + v + 1) * B - (admitted - rejected) = (1 + 3 + 1) * 4 - (15 - 2) = 7
    assert admission_capacity(1, 3, 4.0, accepted_or_running=13, generating=5, starving=False) == 7
    # synchronous mode: only the current version's prompts
    assert admission_capacity(0, 0, 4.0, accepted_or_running=4, generating=4, starving=True) == 0
    assert admission_capacity(0, 1, 4.0, accepted_or_running=4, generating=0, starving=True) == 4
    # never negative
    assert admission_capacity(1, 0, 2.0, accepted_or_running=50, generating=3, starving=False) == 0


def test_starving_with_nothing_generating_admits_a_step_anyway():
    assert admission_capacity(1, 0, 2.5, accepted_or_running=50, generating=0, starving=True) == 3


def test_prompts_per_step_uses_observed_group_size():
    assert prompts_per_step(512, 64.0, 8, 16) == 8.0
    assert prompts_per_step(512, None, 8, 16) == 8.0  # prior: n * max_tokens / 2 = 64
    assert prompts_per_step(10, 1000.0, 8, 16) == 1.0


def test_assignment_goes_to_least_loaded_and_respects_the_cap():
    assert assign_prompts(5, {0: 3, 1: 0}, max_per_actor=10) == {0: 1, 1: 4}
    assert assign_prompts(5, {0: 2, 1: 2}, max_per_actor=3) == {0: 1, 1: 1}
    assert sum(assign_prompts(7, {0: 0, 1: 0, 2: 0}, 100).values()) == 7
    # only the actors listed (the live ones) get prompts
    assert assign_prompts(3, {2: 0, 5: 1}, max_per_actor=10) == {2: 2, 5: 1}
    assert assign_prompts(3, {}, max_per_actor=10) == {}


def test_assignment_by_requests_adds_a_group_a_prompt_and_fills_an_actor_just_below_its_cap():
    # loads in requests, 4 a prompt, cap 16: actor 0 (13 running) takes one prompt and goes to
    # 17; actor 1 (2) takes prompts at 2, 6, 10, 14 and stops at 18
    assert assign_prompts(10, {0: 13, 1: 2}, max_per_actor=16, per_prompt=4) == {0: 1, 1: 4}
    assert assign_prompts(10, {0: 16}, max_per_actor=16, per_prompt=4) == {}


def chunk(n_prompt, n_resp):
    return SequenceChunk("g", 0, [1] * n_prompt, [2] * n_resp, 0, [0.0] * n_resp, [0] * n_resp, 1.0)


def test_rank_split_balances_tokens_and_keeps_every_chunk():
    chunks = [chunk(2, n) for n in (10, 9, 8, 3, 2, 1)]
    parts = split_for_ranks(chunks, 2)
    loads = [sum(c.num_tokens for c in p) for p in parts]
    assert sorted(id(c) for p in parts for c in p) == sorted(id(c) for c in chunks)
    # longest-first greedy on lengths 12,11,10,5,4,3: {12,5,4,3} and {11,10}
    assert sorted(loads) == [21, 24]
    assert max(loads) - min(loads) <= max(c.num_tokens for c in chunks)
    assert split_for_ranks([], 3) == [[], [], []]


def test_micro_batches_bound_tokens_but_keep_a_long_chunk_whole():
    chunks = [chunk(2, 3), chunk(2, 3), chunk(2, 20), chunk(1, 1)]
    for packed in (True, False):
        mbs = micro_batches(chunks, max_tokens=10, packed=packed)
        assert [[c.num_tokens for c in m] for m in mbs] == [[22], [5, 5], [2]]
        assert sorted(id(c) for m in mbs for c in m) == sorted(id(c) for c in chunks)  # each chunk once


def test_packed_micro_batches_are_filled_first_fit_longest_first():
    # 6, 5, 5, 4 into 10: cut in arrival order that is 3 micro-batches ([6], [5, 5], [4]); filled
    # by length, 2, both full
    chunks = [chunk(1, n - 1) for n in (6, 5, 5, 4)]
    mbs = micro_batches(chunks, max_tokens=10, packed=True)
    assert [[c.num_tokens for c in m] for m in mbs] == [[6, 4], [5, 5]]


def test_padded_micro_batches_group_similar_lengths():
    # padded rows cost (rows x longest): sorted and cut consecutively, 9 | 8 3 | 2 pads to
    # 9 + 16 + 2 = 27 tokens, where arrival order (2 9 | 3 8) pads to 18 + 16 = 34
    chunks = [chunk(1, n - 1) for n in (2, 9, 3, 8)]
    mbs = micro_batches(chunks, max_tokens=12, packed=False)
    assert [[c.num_tokens for c in m] for m in mbs] == [[9], [8, 3], [2]]
    assert sum(len(m) * max(c.num_tokens for c in m) for m in mbs) == 27


def test_rollout_batch_capacity_synchronous_waits_for_the_last_step():
    # staleness 0: nothing while the current batch still has steps (or one is training)
    assert rollout_batch_capacity(0, steps_until_seal=1, steps_per_batch=4, batch_prompts=16, waiting=0) == 0
    # the batch is used up: one rollout batch's worth, minus what is already running or collecting
    assert rollout_batch_capacity(0, 0, 4, 16, waiting=0) == 16
    assert rollout_batch_capacity(0, 0, 4, 16, waiting=10) == 6
    assert rollout_batch_capacity(0, 0, 4, 16, waiting=20) == 0


def test_rollout_batch_capacity_looks_ahead_by_the_staleness_bound():
    # staleness 4, batches of 4 steps: the next seal is 3 steps away -> one batch ahead
    assert rollout_batch_capacity(4, 3, 4, 16, waiting=0) == 16
    # next seal now, and the one after 4 steps later is also within the bound -> two batches
    assert rollout_batch_capacity(4, 0, 4, 16, waiting=0) == 32
    assert rollout_batch_capacity(4, 5, 4, 16, waiting=0) == 0


def test_groups_held_by_verifiers_do_not_count_against_the_bound():
    # bound: (1 + 3 + 1) * 4 = 20; 20 admitted, none rejected: full, unless 3 of them sit in verifiers
    assert admission_capacity(1, 3, 4.0, accepted_or_running=20, generating=2, starving=False) == 0
    assert admission_capacity(1, 3, 4.0, accepted_or_running=20, generating=2, starving=False,
                              held_by_verifiers=3) == 3
    # with rejections too: 20 - (23 - 2 - 3) = 2
    assert admission_capacity(1, 3, 4.0, accepted_or_running=21, generating=0, starving=False,
                              held_by_verifiers=3) == 2


def test_requeued_groups_keep_their_own_sampling_settings():
    from types import SimpleNamespace

    from asyncrl.orchestrator.ledger import group_by_settings
    from asyncrl.rollout.engine import SamplingSpec

    def rec(pid, max_tokens, n):
        return SimpleNamespace(prompt=pid, spec=SamplingSpec(1.0, 1.0, max_tokens), group_size=n)

    out = group_by_settings([rec("a", 8, 4), rec("b", 16, 6), rec("c", 8, 4)])
    assert out == [(SamplingSpec(1.0, 1.0, 8), 4, ["a", "c"]), (SamplingSpec(1.0, 1.0, 16), 6, ["b"])]
