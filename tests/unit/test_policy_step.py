import pytest
import torch

from asyncrl.algo.aggregation import StepCounts
from asyncrl.buffer.packing import micro_batches
from asyncrl.config import AlgoConfig
from asyncrl.learner.collate import collate
from asyncrl.learner.policy_step import forward_backward
from asyncrl.types import SequenceChunk


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


def grads(model, mbs_chunks, algo):
    model.zero_grad()
    counts = StepCounts.from_sequence_lengths([c.num_loss_tokens for mb in mbs_chunks for c in mb], token_budget=64)
    metrics = forward_backward(lambda mb: model(mb.input_ids), [collate(c) for c in mbs_chunks], algo,
                               counts, temperature=1.0, entropy_chunk=5)
    return [p.grad.clone() for p in model.parameters()], metrics


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
    with torch.no_grad():  # make the behaviour logprobs exactly the model's own
        for c in cs:
            mb = collate([c])
            logp = torch.log_softmax(model(mb.input_ids)[mb.rows, mb.cols], -1).gather(-1, mb.targets[:, None])
            c.old_logprobs = logp.squeeze(-1).tolist()
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
