"""The fourth float64 audit of the correction menu, one test per finding; each failed on the code
before its fix. Expected values are written out by hand in float64 from each method's paper."""

import math

import pytest
import torch

from asyncrl.algo.corrections import (behaviour_weight, cispo_loss, gspo_loss, m2po_candidates, m2po_loss,
                                      m2po_threshold, unclipped_is_loss)
from asyncrl.algo.policy_loss import clipped_policy_loss
from asyncrl.algo.token_decomposition import TokenTable, decompose
from asyncrl.config import AlgoConfig
from asyncrl.learner.policy_step import policy_and_weight

F64 = torch.float64
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _t(values, dtype=F64, grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def test_m2po_masks_in_float32_what_its_float64_cut_chose():
    """Finding 1: the cut was chosen from float64 differences but the mask squared the float32
    difference, which for this token rounds below the cut (0.95376977936 < 0.95376983757): a
    token its own rule removed was trained."""
    a, b = -1.178452968597412, -0.2018415629863739  # float32 values: the float64 casts are exact
    logp = _t([a, -0.5, -0.7, -0.9], torch.float32, grad=True)
    old = _t([b, -0.5, -0.7, -0.9], torch.float32)
    cut = (float(torch.tensor(a, dtype=torch.float32)) - float(torch.tensor(b, dtype=torch.float32))) ** 2
    assert float((logp.detach() - old)[0].double() ** 2) < cut  # the float32 difference rounds below it
    # M2 = cut / 4 = 0.238 > tau 0.04: the rule masks token 0, and then M2 = 0 fits
    assert m2po_threshold((logp.detach().double() - old.double()), 0.04) == cut
    loss, diag = m2po_loss(logp, old, _t([1.0, 1.0, 1.0, 1.0], torch.float32), cut)
    loss.sum().backward()
    assert diag["masked"].tolist() == [True, False, False, False]
    assert loss[0].item() == 0.0 and logp.grad[0].item() == 0.0


def test_decoupled_m2po_takes_its_second_moment_over_the_behaviour_policy():
    """Finding 2: decoupled, M2 was over pi_theta / pi_prox, which is 1 on a streaming step, so
    nothing was ever masked; the paper's M2 is over pi_theta / pi_b. pi_prox = pi_theta here (a
    step that is its own rollout batch), log pi_b = log pi_theta - d."""
    logp = _t([-1.0, -2.0, -0.5, -1.5], grad=True)
    d = [0.1, -0.9, 0.05, 0.6]  # squares 0.01, 0.81, 0.0025, 0.36: M2 0.2956 > 0.04
    old = logp.detach() - _t(d)
    adv = _t([1.0, -1.0, 0.5, 2.0])
    # by hand: mask 0.81 -> (0.01 + 0.0025 + 0.36) / 3 = 0.124 > 0.04; mask 0.36 too -> 0.00625: cut 0.36
    cut = m2po_threshold(logp.detach() - old, 0.04)
    assert cut == pytest.approx(0.36, abs=1e-15)
    algo = AlgoConfig(policy_loss="m2po", decoupled=True, is_weight_cap=2.0)
    loss, diag = policy_and_weight(algo, logp, old, adv, torch.arange(4), logp.detach(), cut)
    loss.sum().backward()
    assert diag["masked"].tolist() == [False, True, False, True]
    # kept tokens: -r A w with r = pi_theta / pi_prox = 1 (gradient r A w) and w = min(e^d, 2)
    w = [min(math.exp(x), 2.0) for x in d]
    want = [-1.0 * a * wt if not m else 0.0 for a, wt, m in zip(adv.tolist(), w, [False, True, False, True])]
    assert loss.tolist() == pytest.approx(want, abs=1e-15)
    assert logp.grad.tolist() == pytest.approx(want, abs=1e-15)


def test_cispo_has_no_lower_bound_unless_asked():
    """Finding 3: CISPO's weight was clipped below at 1 - eps_low; MiniMax-M1 (eq. 4-5) clips it
    above only. d l_t / d logp_t = -w_t A_t, w_t = min(r_t, 1 + eps_high)."""
    d = [-0.5, 0.0, 0.4]  # r = 0.607, 1, 1.492
    logp = _t([-1.0, -2.0, -0.3], grad=True)
    old = logp.detach() - _t(d)
    adv = _t([1.0, -2.0, 0.5])
    loss, diag = cispo_loss(logp, old, adv, None, 0.28)
    loss.sum().backward()
    w = [math.exp(-0.5), 1.0, 1.28]
    assert logp.grad.tolist() == pytest.approx([-wt * a for wt, a in zip(w, adv.tolist())], abs=1e-15)
    assert diag["clipped_low"].tolist() == [False, False, False]
    assert diag["clipped_high"].tolist() == [False, False, True]
    banded, diag = cispo_loss(logp, old, adv, 0.2, 0.28)  # a band on request: the first weight is 0.8
    assert banded[0].item() == pytest.approx(-0.8 * 1.0 * -1.0, abs=1e-15) and diag["clipped_low"][0]
    with pytest.raises(ValueError, match="cispo_eps_low applies to algo.policy_loss=cispo"):
        AlgoConfig(cispo_eps_low=0.2)


def test_m2po_can_mask_only_where_ppos_clip_would_act():
    """Finding 4: the candidates were all tokens; the authors' code masks only where PPO's clip
    could act (A > 0 with q > 1 + eps_high, A < 0 with q < 1 - eps_low). M2 stays over all tokens."""
    q = [0.9, -0.9, 0.5, 0.05]  # log q; squares 0.81, 0.81, 0.25, 0.0025
    adv = _t([-1.0, -1.0, 1.0, 1.0])  # token 0: A < 0 with q > 1: PPO's clip would not act
    candidates = m2po_candidates(_t(q), adv, "clip", 0.2, 0.28)
    assert candidates.tolist() == [False, True, True, False]
    # all tokens: mask 0.81, 0.81 -> (0.25 + 0.0025) / 2 = 0.126 > 0.04; mask 0.25 -> 0.0025: cut 0.25
    assert m2po_threshold(_t(q), 0.04) == pytest.approx(0.25, abs=1e-15)
    # candidates only: mask 0.81 (token 1) -> 1.0625 / 3 = 0.354; mask 0.25 -> 0.8125 / 2 = 0.406:
    # no candidate left, so both are masked and token 0 (0.81) is kept
    cut = m2po_threshold(_t(q), 0.04, candidates)
    assert cut == pytest.approx(0.25, abs=1e-15)
    logp = _t([-1.0, -1.0, -1.0, -1.0], grad=True)
    old = logp.detach() - _t(q)
    _, diag = m2po_loss(logp, old, adv, cut, candidates=candidates)
    assert diag["masked"].tolist() == [False, True, True, False]
    assert AlgoConfig(policy_loss="m2po").m2po_candidates == "all"  # AReaL's reading stays the default


def test_gspo_takes_its_papers_aggregation():
    """Finding 5: under the default budget aggregation GSPO weighted sequences by length (its
    gradient direction off the paper's per-sequence mean); now set when not chosen, refused when
    another is."""
    assert AlgoConfig(policy_loss="gspo").aggregation == "seq_mean_token_mean"
    with pytest.raises(ValueError, match="needs algo.aggregation=seq_mean_token_mean"):
        AlgoConfig(policy_loss="gspo", aggregation="budget")
    assert AlgoConfig().aggregation == "budget"


def test_no_ratio_or_weight_is_inf():
    """Finding 6: an uncapped weight reached inf and the step's gradient NaN; PPO and GSPO took
    exp of the raw log-ratio. Now log-ratios are clamped as verl clamps them: +-20 a token, 10 for
    GSPO's sequence mean, and every weight stays finite."""
    logp = _t([-1.0, -1.0], grad=True)
    old = _t([-1001.0, -1.0])  # log-ratio 1000 on the first token
    adv = _t([1.0, 1.0])
    for loss, diag in (clipped_policy_loss(logp, old, adv, 0.2, 0.28), unclipped_is_loss(logp, old, adv),
                       cispo_loss(logp, old, adv, None, 0.28)):
        assert torch.isfinite(loss).all() and diag["ratio"][0].item() == pytest.approx(math.exp(20.0), rel=1e-15)
    seq = gspo_loss(logp, old, adv, torch.tensor([0, 0]), 0.2, 0.28)[1]["ratio"]
    assert seq.tolist() == pytest.approx([math.exp(10.0)] * 2, rel=1e-15)  # mean 500, clamped at 10
    long_seq = _t([30.0] * 40)  # a sequence's product e^1200, untruncated
    for name in ("token_tis", "seq_tis"):
        weight, _ = behaviour_weight(name, long_seq, cap=None, seq_ids=torch.zeros(40, dtype=torch.long))
        assert torch.isfinite(weight).all() and weight.max().item() == pytest.approx(math.exp(20.0), rel=1e-15)
    is_loss, _ = unclipped_is_loss(logp, old, adv)
    is_loss.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_the_k3_metrics_and_their_documentation_agree_on_the_clamp():
    """Finding 7: mismatch_k3 and sampler_k3 clamp d_t at 20 inside exp; the docstring and the
    metrics reference stated the formula without it."""
    d = [25.0, 0.5]
    logp = _t([-1.0, -1.0])
    table = TokenTable.from_policy_loss(0, torch.tensor([0, 0]), logp, _t([1.0, 1.0]), logp - _t(d),
                                        _t([1.0, 1.0]), {"ratio": torch.exp(_t(d))}, torch.tensor([2, 2]))
    out = decompose(table, 16)
    want = sum(math.exp(min(x, 20.0)) - x - 1.0 for x in d) / 2
    assert out["offpolicy/sampler_k3"] == pytest.approx(want, rel=1e-15)
    assert out["offpolicy/mismatch_k3"] == pytest.approx(want, rel=1e-15)
    metrics_md = (ROOT / "docs/reference/metrics.md").read_text()
    assert "`mismatch_k3` = mean (exp(min(d_t, 20)) - d_t - 1)" in metrics_md
    assert "`sampler_k3` = mean (exp(min(d_t, 20)) - d_t - 1)" in metrics_md
