import pytest
import torch

from asyncrl.algo.aggregation import AGGREGATIONS, StepCounts, token_weights, weighted_sum
from asyncrl.algo.policy_loss import clipped_policy_loss

F64 = torch.float64
LENGTHS = [3, 1, 4, 2, 5]  # loss tokens of each sequence of the step
PHI = 20


def _reference(per_seq_terms, aggregation):
    """The four aggregations written straight from their definitions, in plain float64."""
    flat = [x for seq in per_seq_terms for x in seq]
    if aggregation == "budget":
        return sum(flat) / PHI
    if aggregation == "token_mean":
        return sum(flat) / len(flat)
    if aggregation == "seq_mean_token_mean":
        return sum(sum(seq) / len(seq) for seq in per_seq_terms) / len(per_seq_terms)
    return sum(sum(seq) for seq in per_seq_terms) / len(per_seq_terms)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_full_batch_matches_definition(aggregation):
    terms = [[0.5, -1.0, 2.0], [3.0], [1.0, 1.0, -2.0, 0.25], [-0.5, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0]]
    seq_len = torch.tensor([len(s) for s in terms for _ in s])
    weights = token_weights(aggregation, seq_len, StepCounts.from_sequence_lengths(LENGTHS, PHI), F64)
    got = weighted_sum(torch.tensor([x for s in terms for x in s], dtype=F64), weights)
    assert float(got) == pytest.approx(_reference(terms, aggregation), abs=1e-12)


def _batch():
    """A tiny policy: W[ctx] are the logits of a token; per-token clipped loss + entropy."""
    g = torch.Generator().manual_seed(0)
    num_tokens = sum(LENGTHS)
    seq_ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    return {
        "W": torch.randn(4, 6, dtype=F64, generator=g),
        "ctx": torch.randint(0, 4, (num_tokens,), generator=g),
        "target": torch.randint(0, 6, (num_tokens,), generator=g),
        "old": -torch.rand(num_tokens, dtype=F64, generator=g) * 2,
        "adv": torch.randn(len(LENGTHS), dtype=F64, generator=g)[seq_ids],
        "seq_ids": seq_ids,
        "seq_len": torch.tensor(LENGTHS)[seq_ids],
    }


def _per_token(W, b, idx):
    logp_all = torch.log_softmax(W[b["ctx"][idx]], -1)
    logp = logp_all.gather(-1, b["target"][idx, None]).squeeze(-1)
    pg, _ = clipped_policy_loss(logp, b["old"][idx], b["adv"][idx], 0.2, 0.28)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return pg, entropy


def _full_batch_gradient(b, aggregation):
    W = b["W"].clone().requires_grad_(True)
    pg, entropy = _per_token(W, b, torch.arange(sum(LENGTHS)))
    per_seq = [(pg - 0.01 * entropy)[b["seq_ids"] == s].tolist() for s in range(len(LENGTHS))]
    terms = pg - 0.01 * entropy
    # reference built from the definitions with autograd: index sequences, then reduce
    seqs = [terms[b["seq_ids"] == s] for s in range(len(LENGTHS))]
    if aggregation == "budget":
        loss = terms.sum() / PHI
    elif aggregation == "token_mean":
        loss = terms.mean()
    elif aggregation == "seq_mean_token_mean":
        loss = torch.stack([s.mean() for s in seqs]).mean()
    else:
        loss = torch.stack([s.sum() for s in seqs]).mean()
    assert float(loss.detach()) == pytest.approx(_reference(per_seq, aggregation), abs=1e-12)
    loss.backward()
    return float(loss.detach()), W.grad


def _split_gradient(b, aggregation, rank_cut, num_micro):
    """Two simulated ranks ([0, rank_cut) and [rank_cut, T)), each accumulating num_micro
    micro-batches; the gradients of the ranks are then summed (the all-reduce)."""
    counts = StepCounts.from_sequence_lengths(LENGTHS, PHI)
    total_loss, rank_grads = 0.0, []
    for rank_tokens in (torch.arange(0, rank_cut), torch.arange(rank_cut, sum(LENGTHS))):
        W = b["W"].clone().requires_grad_(True)
        for idx in rank_tokens.tensor_split(num_micro):
            pg, entropy = _per_token(W, b, idx)
            weights = token_weights(aggregation, b["seq_len"][idx], counts, F64)
            loss = weighted_sum(pg, weights) - 0.01 * weighted_sum(entropy, weights)
            if idx.numel():
                loss.backward()
            total_loss += float(loss.detach())
        rank_grads.append(W.grad if W.grad is not None else torch.zeros_like(W))
    return total_loss, rank_grads[0] + rank_grads[1]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("num_micro", [1, 2, 3])
@pytest.mark.parametrize("rank_cut", [0, 6, 9])  # 0: rank 0 has no tokens; 6 and 9 cut sequences
def test_gradient_is_independent_of_micro_batches_and_ranks(aggregation, num_micro, rank_cut):
    b = _batch()
    full_loss, full_grad = _full_batch_gradient(b, aggregation)
    split_loss, split_grad = _split_gradient(b, aggregation, rank_cut, num_micro)
    assert split_loss == pytest.approx(full_loss, abs=1e-12)
    assert torch.allclose(split_grad, full_grad, atol=1e-12, rtol=0)


def test_local_normalization_would_break_invariance():
    # the point of global counts: a per-micro-batch token mean differs from the full-batch mean
    terms = torch.tensor([1.0, 2.0, 3.0, 10.0], dtype=F64)
    local = terms[:3].mean() / 2 + terms[3:].mean() / 2
    weights = token_weights("token_mean", torch.ones(4, dtype=torch.long), StepCounts(4, 1), F64)
    assert float(weighted_sum(terms, weights)) == pytest.approx(4.0)
    assert float(local) != pytest.approx(4.0)


def test_empty_micro_batch_contributes_zero():
    empty = torch.zeros(0, dtype=torch.long)
    for aggregation in AGGREGATIONS:
        w = token_weights(aggregation, empty, StepCounts(0, 0, PHI), F64)
        assert w.shape == (0,) and float(weighted_sum(torch.zeros(0, dtype=F64), w)) == 0.0


def test_step_counts_and_errors():
    assert StepCounts.from_sequence_lengths([3, 0, 2], 8) == StepCounts(5, 2, 8)
    one = torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError):
        token_weights("budget", one, StepCounts(2, 1))
    with pytest.raises(ValueError):
        token_weights("token_mean", one, StepCounts(0, 1))
    with pytest.raises(ValueError):
        token_weights("seq_mean_token_mean", torch.zeros(2, dtype=torch.long), StepCounts(2, 1))
    with pytest.raises(ValueError):
        token_weights("mean_of_means", one, StepCounts(2, 1))
    with pytest.raises(ValueError):
        weighted_sum(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError):
        StepCounts.from_sequence_lengths([1, -1])
