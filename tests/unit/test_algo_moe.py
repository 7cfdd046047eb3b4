import math

import pytest
import torch

from asyncrl.algo.moe import load_balance_from_sums, load_balance_loss, load_balance_share, router_sums, router_z_loss

L3 = math.log(3.0)


def test_load_balance_hand_values():
    # k=1, E=2. Balanced choices: f = [.5, .5], P = [.5, .5] -> 2 * (.25 + .25) = 1
    balanced = torch.tensor([[L3, 0.0], [0.0, L3]], dtype=torch.float64)
    assert float(load_balance_loss([balanced], top_k=1)) == pytest.approx(1.0, abs=1e-12)
    # both tokens on expert 0: f = [1, 0], P = [.75, .25] -> 2 * .75 = 1.5
    skewed = torch.tensor([[L3, 0.0], [L3, 0.0]], dtype=torch.float64)
    assert float(load_balance_loss([skewed], top_k=1)) == pytest.approx(1.5, abs=1e-12)


def test_uniform_routing_gives_k():
    logits = torch.zeros(10, 4)
    assert float(load_balance_loss([logits, logits], top_k=2)) == pytest.approx(2.0)


def test_padding_positions_are_excluded_and_layers_pooled():
    skewed = torch.tensor([[L3, 0.0], [L3, 0.0]], dtype=torch.float64)
    # token 1 of layer 0 would balance it, but it is padding
    layer0 = torch.tensor([[L3, 0.0], [0.0, L3]], dtype=torch.float64)
    mask = torch.tensor([[1, 0]])
    assert float(load_balance_loss([layer0, skewed], 1, mask)) == pytest.approx(1.5, abs=1e-12)
    assert float(router_z_loss([layer0, skewed], mask)) == pytest.approx(math.log(4.0) ** 2, abs=1e-12)


def test_z_loss_hand_value_and_empty():
    x = torch.tensor([[L3, 0.0], [0.0, 0.0]], dtype=torch.float64)
    want = (math.log(4.0) ** 2 + math.log(2.0) ** 2) / 2
    assert float(router_z_loss([x])) == pytest.approx(want, abs=1e-12)
    empty = torch.zeros(0, 3)
    assert float(router_z_loss([empty])) == 0.0 and float(load_balance_loss([empty], 1)) == 0.0


def test_shares_with_the_step_fractions_add_up_to_the_whole_batch():
    """k=1, E=2, tokens t1, t2 -> expert 0 (p = .75, .25), t3 -> expert 1 (p = .25, .75).
    Whole: f = (2/3, 1/3), P = (1.75/3, 1.25/3), L = 2 * (3.5 + 1.25) / 9 = 19/18. Each half alone
    gives 1.5 (so any weighting of per-half values is 1.5, not 19/18). With the step's f and
    N = 3: the half {t1, t2} adds 2 * (2/3 * 1.5 + 1/3 * .5) / 3 = 14/18, {t3} adds
    2 * (2/3 * .25 + 1/3 * .75) / 3 = 5/18; z: (2 ln(4)^2 + ln(4)^2) / 3 split as 2/3 and 1/3."""
    first = torch.tensor([[L3, 0.0], [L3, 0.0]], dtype=torch.float64, requires_grad=True)
    second = torch.tensor([[0.0, L3]], dtype=torch.float64, requires_grad=True)
    whole = router_sums([torch.cat([first, second]).detach()], top_k=1)
    assert whole.counts.tolist() == [[2.0, 1.0]] and whole.num == 3
    assert float(load_balance_from_sums(whole.counts, whole.prob_sum, whole.num)) == pytest.approx(19 / 18, abs=1e-15)
    a, b = router_sums([first], 1), router_sums([second], 1)
    assert float(load_balance_from_sums(a.counts, a.prob_sum.detach(), a.num)) == pytest.approx(1.5, abs=1e-15)
    frac = whole.counts / whole.num
    share_a, share_b = load_balance_share(a.prob_sum, frac, 3), load_balance_share(b.prob_sum, frac, 3)
    assert float(share_a.detach()) == pytest.approx(14 / 18, abs=1e-15) and float(share_b.detach()) == pytest.approx(5 / 18, abs=1e-15)
    # the gradient of the two shares is the whole batch's (f held fixed)
    (share_a + share_b).backward()
    got = torch.cat([first.grad, second.grad])
    both = torch.cat([first, second]).detach().requires_grad_(True)
    load_balance_share(router_sums([both], 1).prob_sum, frac, 3).backward()
    torch.testing.assert_close(got, both.grad, atol=1e-15, rtol=0)
    assert float((a.lse_sq_sum + b.lse_sq_sum).detach() / 3) == pytest.approx(math.log(4.0) ** 2, abs=1e-15)
    assert float(router_z_loss([torch.cat([first, second]).detach()])) == pytest.approx(math.log(4.0) ** 2, abs=1e-15)
