import math

import pytest
import torch

from asyncrl.algo.aggregation import StepCounts
from asyncrl.algo.token_stats import token_logprobs_and_entropy
from asyncrl.learner.micro_batches import micro_batches
from asyncrl.config import AlgoConfig
from asyncrl.learner.collate import collate
from asyncrl.learner.model_forward import TokenForward
from asyncrl.learner.policy_step import MoeStep, forward_backward, padding_loss
from asyncrl.learner.proximal import ProximalLogprobs
from asyncrl.types import ResponseSpan, SequenceChunk


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=13, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        h = torch.cumsum(torch.tanh(self.mix(self.emb(ids))), dim=1)  # causal: prefix sums
        return self.out(h)


def chunks():
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(6):
        n_prompt, n_resp = 2 + i % 3, 3 + i
        ids = torch.randint(1, 13, (n_prompt + n_resp,), generator=g).tolist()
        start = i % 2
        out.append(SequenceChunk(f"g{i}", 0, ids[:n_prompt], ids[n_prompt:], start,
                                 (-torch.rand(n_resp - start, generator=g)).tolist(), [0] * (n_resp - start),
                                 advantage=(-1.0) ** i * (0.5 + i / 10)))
    return out


def tiny_forward(model):
    def forward(mb):
        return TokenForward(*token_logprobs_and_entropy(model(mb.input_ids)[mb.rows, mb.cols], mb.targets, 1.0, 5))
    return forward


def grads(model, mbs_chunks, algo, **kwargs):
    model.zero_grad()
    counts = StepCounts.from_sequence_lengths([c.num_loss_tokens for mb in mbs_chunks for c in mb], token_budget=64)
    kwargs.setdefault("entropy_coef", algo.entropy_coef)
    metrics = forward_backward(tiny_forward(model), [collate(c) for c in mbs_chunks], algo, counts, **kwargs)
    return [p.grad.clone() for p in model.parameters()], metrics


def own_logprobs(model, c):
    with torch.no_grad():
        mb = collate([c])
        logp = torch.log_softmax(model(mb.input_ids)[mb.rows, mb.cols], -1).gather(-1, mb.targets[:, None])
    return logp.squeeze(-1)


@pytest.mark.parametrize("aggregation", ["budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_gradient_does_not_depend_on_micro_batching(aggregation):
    algo = AlgoConfig(aggregation=aggregation, entropy_coef=0.01)
    model = TinyLM()
    cs = chunks()
    whole, m_whole = grads(model, [cs], algo)
    for max_tokens in (12, 20, 30):
        split, m_split = grads(model, micro_batches(cs, max_tokens), algo)
        for a, b in zip(whole, split):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert m_split["learner/loss_tokens"] == m_whole["learner/loss_tokens"]
        assert m_split["loss/total"] == pytest.approx(m_whole["loss/total"], abs=1e-6)


def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage_over_budget():
    model = TinyLM()
    cs = chunks()
    for c in cs:  # make the behaviour logprobs exactly the model's own
        c.old_logprobs = own_logprobs(model, c).tolist()
    _, m = grads(model, [cs], AlgoConfig(aggregation="budget"))
    expected = -sum(c.advantage * c.num_loss_tokens for c in cs) / 64
    assert m["ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["loss/policy"] == pytest.approx(expected, abs=1e-5)
    assert m["clip/low_frac"] == 0 and m["clip/high_frac"] == 0


def test_dual_clip_caps_negative_advantage_tokens_and_is_reported():
    model = TinyLM()
    cs = chunks()
    for c in cs:  # behaviour logprobs far below the model's: huge ratios everywhere
        c.old_logprobs = [-30.0] * c.num_loss_tokens
    _, plain = grads(model, [cs], AlgoConfig())
    _, dual = grads(model, [cs], AlgoConfig(dual_clip=3.0))
    assert plain["clip/dual_frac"] == 0.0
    neg_tokens = sum(c.num_loss_tokens for c in cs if c.advantage < 0)
    total = sum(c.num_loss_tokens for c in cs)
    assert dual["clip/dual_frac"] == pytest.approx(neg_tokens / total)
    # capped: each negative-advantage token contributes exactly -3 * A to the loss sum
    expected = (sum(-1.28 * c.advantage * c.num_loss_tokens for c in cs if c.advantage > 0)
                + sum(-3.0 * c.advantage * c.num_loss_tokens for c in cs if c.advantage < 0)) / 64
    assert dual["loss/policy"] == pytest.approx(expected, rel=1e-5)


def reference_grads(model, cs, term, per_sequence=False):
    """Gradient of sum over tokens of term(logp, chunk) / 64 (or, per_sequence, the mean over
    chunks of each chunk's mean term: GSPO's aggregation), straight from autograd (the reference)."""
    model.zero_grad()
    total = 0
    for c in cs:
        mb = collate([c])
        logp = torch.log_softmax(model(mb.input_ids)[mb.rows, mb.cols], -1).gather(-1, mb.targets[:, None]).squeeze(-1)
        total = total + (term(logp, c).mean() / len(cs) if per_sequence else term(logp, c).sum() / 64)
    total.backward()
    return [p.grad.clone() for p in model.parameters()], float(total)


def test_decoupled_gradient_is_advantage_times_truncated_weight():
    """pi_prox = pi_theta at the step start, so rho = 1 and d loss = -A * min(pi_prox / pi_b, C) * d logp."""
    model = TinyLM()
    cs = chunks()
    for c in cs:  # behaviour policy: the model's logprobs shifted per token, so w spans both sides of C
        own = own_logprobs(model, c)
        c.old_logprobs = (own + torch.linspace(-1.0, 1.0, len(own))).tolist()
    cap = 1.5
    got, m = grads(model, [cs], AlgoConfig(decoupled=True, is_weight_cap=cap))

    def term(logp, c):
        w = torch.clamp(torch.exp(logp.detach() - torch.tensor(c.old_logprobs)), max=cap)
        return -c.advantage * w * torch.exp(logp - logp.detach())
    want, loss = reference_grads(model, cs, term)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert m["loss/policy"] == pytest.approx(loss, abs=1e-6)
    assert m["ratio/mean"] == pytest.approx(1.0) and m["clip/low_frac"] == m["clip/high_frac"] == 0
    shifts = [s for c in cs for s in torch.linspace(-1.0, 1.0, c.num_loss_tokens).tolist()]
    assert m["is_weight/capped_frac"] == pytest.approx(sum(math.exp(-s) > cap for s in shifts) / len(shifts))
    assert m["is_weight/max"] == pytest.approx(cap)
    assert m["is_weight/min"] == pytest.approx(math.exp(-1.0), rel=1e-5)


def test_kl_term_value_and_gradient_against_a_shifted_reference():
    """ref = logp - 0.3 everywhere: d = -0.3, k3 = e^-0.3 + 0.3 - 1 per token; loss += beta * sum k3 / Phi."""
    model = TinyLM()
    cs = chunks()
    for c in cs:
        c.old_logprobs = own_logprobs(model, c).tolist()
    beta = 0.5
    algo = AlgoConfig(kl={"coef": beta, "estimator": "k3"})
    shift = 0.3
    got, m = grads(model, [cs], algo, ref_logprobs=lambda mb: tiny_forward(model)(mb).logprobs.detach() - shift)
    k3 = math.exp(-shift) + shift - 1
    assert m["kl/mean"] == pytest.approx(k3, rel=1e-5)
    n = sum(c.num_loss_tokens for c in cs)
    assert m["loss/kl"] == pytest.approx(k3 * n / 64, rel=1e-5)

    def term(logp, c):
        ratio = torch.exp(logp - logp.detach())
        d = (logp.detach() - shift) - logp
        return -c.advantage * ratio + beta * (torch.exp(d) - d - 1)
    want, loss = reference_grads(model, cs, term)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert m["loss/total"] == pytest.approx(loss, abs=1e-6)


def test_kl_to_an_identical_reference_is_zero_and_adds_no_gradient():
    model = TinyLM()
    cs = chunks()
    plain, _ = grads(model, [cs], AlgoConfig())
    same, m = grads(model, [cs], AlgoConfig(kl={"coef": 1.0}),
                    ref_logprobs=lambda mb: tiny_forward(model)(mb).logprobs.detach())
    assert m["kl/mean"] == 0.0 and m["kl/max"] == 0.0
    for a, b in zip(plain, same):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_entropy_coefficient_enters_the_loss_with_the_aggregation_weights():
    model = TinyLM()
    cs = chunks()
    _, base = grads(model, [cs], AlgoConfig(), entropy_coef=0.0)
    _, bonus = grads(model, [cs], AlgoConfig(), entropy_coef=0.25)
    n = sum(c.num_loss_tokens for c in cs)
    assert bonus["loss/total"] == pytest.approx(base["loss/total"] - 0.25 * base["entropy/learner"] * n / 64, rel=1e-5)
    # E[-log pi_b] over the sampled tokens is what `entropy/behaviour_sampled` reports
    assert base["entropy/behaviour_sampled"] == pytest.approx(
        -sum(sum(c.old_logprobs) for c in cs) / n, rel=1e-6)


def test_decoupled_ratio_on_the_second_step_of_a_rollout_batch_is_against_its_start_and_clips():
    """Two steps over the same rollout batch (N_SGD = 2), float64, by hand. A 'policy' whose
    logprobs are its parameters theta; one response of two tokens, A = +1, pi_b = (1/4, 1/2),
    theta_0 = log(1/2) each, so w = pi_prox / pi_b = (2, 1); token_mean; eps 0.2 / 0.28; SGD 0.4.
    Step 1 (pi_prox = theta_0 = pi_theta): rho = 1, loss (-2 - 1) / 2, grad (-1, -1/2),
    theta_1 = theta_0 + (0.4, 0.2). Step 2, pi_prox still theta_0: rho = (e^0.4, e^0.2); token 0 is
    above 1.28 with A > 0: clipped, -1.28 * 2, no gradient; token 1: -e^0.2, gradient -e^0.2 / 2."""
    theta = torch.full((2,), math.log(0.5), dtype=torch.float64, requires_grad=True)
    chunk = SequenceChunk("g", 0, [1], [5, 6], 0, [math.log(0.25), math.log(0.5)], [0, 0], advantage=1.0)
    mb = collate([chunk])
    mb.old_logprobs = torch.tensor(chunk.old_logprobs, dtype=torch.float64)
    mb.advantages = mb.advantages.double()
    algo = AlgoConfig(decoupled=True, aggregation="token_mean", eps_low=0.2, eps_high=0.28)
    counts = StepCounts.from_sequence_lengths([2])
    prox = ProximalLogprobs()
    prox.open([ResponseSpan.of(chunk)], theta.detach().clone())  # the rollout batch opens

    def step():
        theta.grad = None
        return forward_backward(lambda _: TokenForward(theta, torch.zeros(2, dtype=torch.float64)), [mb], algo,
                                counts, proximal=prox.lookup)
    first = step()
    assert first["ratio/mean"] == 1.0 and first["loss/policy"] == pytest.approx(-1.5, abs=1e-15)
    assert theta.grad.tolist() == pytest.approx([-1.0, -0.5], abs=1e-15)
    assert first["is_weight/mean"] == pytest.approx(1.5, abs=1e-15)
    with torch.no_grad():
        theta -= 0.4 * theta.grad
    second = step()
    e4, e2 = math.exp(0.4), math.exp(0.2)
    assert second["ratio/mean"] == pytest.approx((e4 + e2) / 2, abs=1e-14)
    assert second["ratio/max"] == pytest.approx(e4, abs=1e-14) and second["clip/high_frac"] == 0.5
    assert second["loss/policy"] == pytest.approx((-1.28 * 2 - e2) / 2, abs=1e-14)
    assert theta.grad.tolist() == pytest.approx([0.0, -e2 / 2], abs=1e-14)
    assert second["is_weight/mean"] == pytest.approx(1.5, abs=1e-15)  # pi_prox / pi_b: fixed too


def test_proximal_table_keeps_the_previous_batch_for_its_carried_tail_and_slices_by_position():
    prox = ProximalLogprobs()
    prox.open([ResponseSpan("a", 0, 1, 3), ResponseSpan("b", 0, 0, 2)], torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0]))
    prox.open([ResponseSpan("c", 0, 0, 1)], torch.tensor([-6.0]))
    tail = SequenceChunk("a", 0, [1], [7, 7, 7, 7], 3, [0.0], [0], 1.0)  # a's last token: carried over
    mb = collate([tail, SequenceChunk("c", 0, [1], [7], 0, [0.0], [0], 1.0)])
    assert prox.lookup(mb).tolist() == [-3.0, -6.0]
    prox.open([], torch.zeros(0))  # a third batch: the first one's entries are gone
    with pytest.raises(KeyError, match="a/0"):
        prox.lookup(collate([tail]))
    with pytest.raises(ValueError):
        prox.open([ResponseSpan("d", 0, 0, 2)], torch.zeros(3))


def reached_outputs(loss_of):
    """Which outputs of a forward (logprobs, entropy, each layer's router logits) `loss_of(out)`
    sends a gradient to."""
    mb = collate(chunks()[:2])
    width = mb.input_ids.numel()
    outs = {"logprobs": torch.randn(mb.num_loss_tokens), "entropy": torch.rand(mb.num_loss_tokens),
            "router0": torch.randn(width, 4), "router1": torch.randn(width, 4)}
    for t in outs.values():
        t.requires_grad_(True)
    loss_of(TokenForward(outs["logprobs"], outs["entropy"], (outs["router0"], outs["router1"])), mb)
    return {name for name, t in outs.items() if t.grad is not None}


@pytest.mark.parametrize("z_coef,aux_coef", [(0.0, 0.0), (0.05, 0.0), (0.0, 0.5)])
@pytest.mark.parametrize("with_moe", [False, True])
def test_padding_loss_is_zero_and_reaches_the_outputs_a_real_loss_reaches(z_coef, aux_coef, with_moe):
    """ZeRO-3 gathers a module's parameters in backward once per output of it that gets a gradient,
    and every rank must gather in the same order: a padding micro-batch's backward must reach what a
    real one's does (ZeRO-3 ranks with unequal micro-batch counts hung when it reached only the
    logprobs)."""
    algo = AlgoConfig(aggregation="token_mean", moe_z_loss_coef=z_coef, moe_aux_loss_coef=aux_coef)
    moe = MoeStep(2, 4, 40, torch.full((2, 4), 0.25)) if with_moe else None

    def real(out, mb):
        counts = StepCounts.from_sequence_lengths([c.num_loss_tokens for c in chunks()[:2]], token_budget=64)
        forward_backward(lambda _: out, [mb], algo, counts, moe=moe)

    def padding(out, mb):
        loss = padding_loss(out, algo, moe)
        assert float(loss) == 0.0
        loss.backward()

    reached = reached_outputs(padding)
    assert reached == reached_outputs(real)
    assert {"logprobs", "entropy"} <= reached


@pytest.mark.parametrize("name", ["is", "cispo", "gspo", "m2po"])
def test_each_policy_loss_gives_the_gradient_of_its_formula_and_splits_like_ppo(name):
    """The learner's gradient under algo.policy_loss equals autograd's of the formula written out
    per chunk (the reference), and does not depend on micro-batching."""
    model = TinyLM()
    cs = chunks()
    for c in cs:  # behaviour logprobs off the model's by -0.3 .. +0.3 per token
        own = own_logprobs(model, c)
        c.old_logprobs = (own + torch.linspace(-0.3, 0.3, len(own))).tolist()
    algo = AlgoConfig(policy_loss=name, eps_low=0.1, eps_high=0.15, m2po_tau=0.01)
    d_all = torch.cat([own_logprobs(model, c) - torch.tensor(c.old_logprobs) for c in cs]).double()
    # m2po: mask the largest d^2 until the mean of the rest <= tau (by hand, sorted descending)
    sq = sorted((d_all ** 2).tolist(), reverse=True)
    k = next(k for k in range(len(sq)) if sum(sq[k:]) / (len(sq) - k) <= 0.01)
    cut = sq[k - 1] if k else math.inf

    def term(logp, c):
        old, a = torch.tensor(c.old_logprobs), c.advantage
        r = torch.exp(logp - old)
        if name == "is":
            return -r * a
        if name == "cispo":  # no lower bound: MiniMax-M1's weight min(r, 1 + eps_high)
            return -torch.clamp(r, max=1.15).detach() * a * logp
        if name == "gspo":
            s = torch.exp((logp - old).mean())
            s_t = s.detach() * torch.exp(logp - logp.detach())
            return -torch.minimum(s_t * a, torch.clamp(s_t, 0.9, 1.15) * a)
        keep = ((logp.detach() - old).double() ** 2 < cut).to(logp.dtype)
        return -keep * r * a

    want, _ = reference_grads(model, cs, term, per_sequence=name == "gspo")  # gspo: its paper's aggregation
    got, m = grads(model, [cs], algo, m2po_cut=cut)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    split, _ = grads(model, micro_batches(cs, 14), algo, m2po_cut=cut)
    for a, b in zip(want, split):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    if name == "m2po":
        assert 0 < k and m["clip/m2po_masked_frac"] == pytest.approx(k / len(sq))


@pytest.mark.parametrize("weight", ["seq_tis", "icepop", "none"])
def test_decoupled_behaviour_weights_multiply_the_ppo_term(weight):
    model = TinyLM()
    cs = chunks()
    for c in cs:
        own = own_logprobs(model, c)
        c.old_logprobs = (own + torch.linspace(-1.0, 1.0, len(own))).tolist()
    algo = AlgoConfig(decoupled=True, behaviour_weight=weight, is_weight_cap=1.5, icepop_low=0.6, icepop_high=1.8)

    def term(logp, c):
        d = logp.detach() - torch.tensor(c.old_logprobs)  # log pi_prox / pi_b (prox = the step start)
        if weight == "seq_tis":
            w = torch.clamp(torch.exp(d.sum()), max=1.5).expand_as(d)
        elif weight == "icepop":
            k = torch.exp(d)
            w = torch.where((k >= 0.6) & (k <= 1.8), k, torch.zeros_like(k))
        else:
            w = torch.ones_like(d)
        return -w * c.advantage * torch.exp(logp - logp.detach())

    want, _ = reference_grads(model, cs, term)
    got, m = grads(model, [cs], algo)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    if weight == "icepop":
        assert 0 < m["is_weight/masked_frac"] < 1


def test_the_step_is_decomposed_by_staleness_when_the_learner_gives_its_version():
    model = TinyLM()
    cs = chunks()
    for i, c in enumerate(cs):
        c.versions = [3 - i % 3] * c.num_loss_tokens  # staleness at version 3: 0, 1, 2, 0, 1, 2
        c.response_length = len(c.response_ids) + 10
    _, m = grads(model, micro_batches(cs, 14), AlgoConfig(), version=3, max_response_tokens=40)
    by_lag = [sum(c.num_loss_tokens for j, c in enumerate(cs) if j % 3 == lag) for lag in range(3)]
    assert [m[f"offpolicy/stale_{lag}/tokens"] for lag in range(3)] == by_lag
    assert m["offpolicy/stale_3-4/tokens"] == 0 and "offpolicy/stale_3-4/entropy" not in m
    assert m["offpolicy/mismatch_tokens"] == by_lag[0]
    # lengths 13..18 of max 40: all in the second quarter (11..20)
    assert m["offpolicy/len_q2/tokens"] == sum(by_lag)
    _, plain = grads(model, [cs], AlgoConfig())
    assert not any(k.startswith("offpolicy/") for k in plain)
