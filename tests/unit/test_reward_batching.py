"""How many waiting calls the reward pool hands an idle worker at once (reward/pool.py)."""

from asyncrl.reward.pool import BATCH_S, MAX_BATCH, batch_size


def test_one_call_at_a_time_until_calls_have_been_timed_or_when_nothing_waits():
    assert batch_size(100, 2, None) == 1
    assert batch_size(0, 2, 1e-6) == 0
    assert batch_size(5, 0, 1e-6) == 0


def test_an_even_share_of_the_queue_bounded_by_time_and_count():
    assert batch_size(10, 4, 1e-6) == 3  # ceil(10 / 4)
    assert batch_size(10_000, 2, 1e-6) == MAX_BATCH
    assert batch_size(10_000, 2, BATCH_S / 5) == 5  # five calls fill BATCH_S
    assert batch_size(10_000, 2, 10 * BATCH_S) == 1  # slow verifiers never batch
    assert batch_size(1, 8, 1e-6) == 1
