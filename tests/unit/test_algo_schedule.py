import pytest

from asyncrl.algo.schedule import minibatch_order, num_sgd_steps


@pytest.mark.parametrize("d_r,d_t,reuse,expected", [
    # Skywork-OR1 section 4.4, quadruples (N_SGD, D_R, D_T, N_reuse)
    (64, 64, 1, 1), (64, 32, 1, 2), (64, 64, 2, 2), (64, 16, 1, 4), (64, 64, 4, 4), (256, 64, 1, 4),
    (256, 64, 3, 12),
])
def test_num_sgd_steps(d_r, d_t, reuse, expected):
    assert num_sgd_steps(d_r, d_t, reuse) == expected


@pytest.mark.parametrize("args", [(64, 48, 1), (64, 0, 1), (0, 16, 1), (64, 16, 0), (64, 16, -1),
                                  (64.0, 16, 1), (64, 16, True), (16, 64, 1)])
def test_num_sgd_steps_validation(args):
    with pytest.raises(ValueError):
        num_sgd_steps(*args)


def test_minibatch_order_passes_over_the_rollout_batch():
    order = minibatch_order(8, 4, 2)
    assert order == [range(0, 4), range(4, 8), range(0, 4), range(4, 8)]
    assert len(order) == num_sgd_steps(8, 4, 2)
    assert minibatch_order(3, 3) == [range(0, 3)]
