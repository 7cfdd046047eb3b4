"""The loss mask of an episode's observation tokens, from the sample through the buffer, the wire
and the learner step: observations are context, never loss, and never count toward Phi."""

from array import array
from collections import deque

import msgpack

import pytest
import torch

from asyncrl.algo.aggregation import StepCounts
from asyncrl.buffer.base import BufferStats, ResponseCursor, cut_budget
from asyncrl.buffer.rollout_batch import RolloutBatchBuffer
from asyncrl.buffer.token_buffer import TokenBuffer
from asyncrl.config import AlgoConfig
from asyncrl.learner.collate import collate
from asyncrl.learner.model_forward import TokenForward
from asyncrl.learner.policy_step import forward_backward
from asyncrl.transport.codec import FrameError, decode_batch, decode_samples, encode_batch, encode_samples
from asyncrl.types import Batch, Group, Sample, ScoredSample, with_lists

MASK = [1, 1, 1, 0, 0, 1, 1]  # turn (3), observation (2), turn (2)


def episode(index=0, versions=None, mask=MASK):
    n = len(mask)
    return Sample("p", "g", index, [5, 6], [1, 2, 3, 9, 9, 4, 7][:n], [-0.5, -0.25, -1.0, 0.0, 0.0, -2.0, -0.125][:n],
                  versions or [0] * n, "stop", 0, loss_mask=list(mask))


def test_the_cut_counts_model_tokens_and_ends_a_chunk_after_its_last_one():
    queue, stats = deque([ResponseCursor(episode(), 1.0)]), BufferStats()
    first = cut_budget(queue, 4, stats)
    assert [(c.loss_start, c.loss_end, list(c.loss_mask), c.num_loss_tokens) for c in first] == [
        (0, 6, [1, 1, 1, 0, 0, 1], 4)]
    assert list(first[0].old_logprobs) == [-0.5, -0.25, -1.0, 0.0, 0.0, -2.0]  # positional, all of the range
    second = cut_budget(queue, 1, stats)
    assert [(c.loss_start, c.loss_end, list(c.loss_mask), c.num_loss_tokens) for c in second] == [(6, 7, [1], 1)]
    assert not queue and stats.responses_trained == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["token", "rollout_batch"])
def test_buffers_hand_out_exactly_phi_model_tokens_and_drop_stale_ones_by_model_count(kind):
    # versions 0,0,0 for the first turn and its observation, 2 for the second turn: at learner
    # version 2 with max_staleness 1 the first turn (3 model tokens) is stale, the observation too
    s = episode(versions=[0, 0, 0, 0, 0, 2, 2])
    g = Group("g", [ScoredSample(s, 1.0), ScoredSample(episode(1, versions=[2] * 7), 0.0)], [0.5, -0.5])
    buf = TokenBuffer(token_budget=4, max_staleness=1) if kind == "token" else \
        RolloutBatchBuffer(token_budget=4, max_staleness=1, rollout_batch_prompts=1)
    buf.add_group(g)
    assert buf.stats.tokens_in == 10 and buf.num_loss_tokens == 10
    chunks = buf.next_batch(learner_version=2)
    assert sum(c.num_loss_tokens for c in chunks) == 4
    assert buf.stats.tokens_dropped_stale == 3
    first = next(c for c in chunks if c.sample_index == 0)
    assert first.loss_start == 5 and list(first.versions) == [2, 2]  # the stale turn and observation are context


def test_masks_cross_the_wire_with_samples_and_batches_and_single_turn_frames_carry_none():
    plain = Sample("p", "g", 1, [5], [1, 2], [-1.0, -1.0], [0, 0], "stop", 0)
    got = decode_samples(encode_samples([episode(), plain]))
    assert [with_lists(s).loss_mask for s in got] == [MASK, []]
    assert "loss_mask" not in msgpack.unpackb(encode_samples([plain]))  # single-turn frames carry none
    scored = [episode(), plain]
    for s in scored:
        s.reward, s.reward_info, s.reward_latency_s = 0.5, {"outcome": "x"}, 0.25
    assert [with_lists(s) for s in decode_samples(encode_samples(scored))] == scored
    chunk = ResponseCursor(episode(), 0.5).chunk(6)
    batch = decode_batch(encode_batch(Batch(0, 0, [chunk], 4, 1, 4)))
    assert list(batch.chunks[0].loss_mask) == MASK[:6] and batch.chunks[0].num_loss_tokens == 4
    bad = episode(mask=[1, 1, 1, 0, 0, 1, 2])
    bad.loss_mask = [1, 1, 1, 0, 0, 1, 2]
    with pytest.raises(ValueError, match="zeros and ones"):
        encode_samples([bad])
    for mask in ([1, 1, 1, 0, 0, 1, 2], [1, 1]):  # a value that is not 0/1; a mask of another length
        frame = msgpack.unpackb(encode_samples([episode()]))
        frame["loss_mask"], frame["mask_lengths"] = array("i", mask).tobytes(), [len(mask)]
        with pytest.raises(FrameError, match="loss_mask"):
            decode_samples(msgpack.packb(frame))


class TableLM(torch.nn.Module):
    """Logits are a float64 parameter per position: the gradient of each row is exactly the
    gradient of the loss with respect to the logits that predict one token."""

    def __init__(self, length, vocab=11):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(length, vocab, dtype=torch.float64,
                                                     generator=torch.Generator().manual_seed(0)))

    def forward(self, ids):
        return self.logits[None, : ids.shape[1]].expand(ids.shape[0], -1, -1)


def test_observation_tokens_get_exactly_zero_gradient_through_the_learner_step():
    s = episode()
    chunk = ResponseCursor(s, 0.75).chunk(len(s.response_ids))
    model = TableLM(len(s.prompt_ids) + len(s.response_ids))
    mb = collate([chunk])

    def forward(mb):
        logp_all = torch.log_softmax(model(mb.input_ids)[mb.rows, mb.cols], -1)
        logp = logp_all.gather(-1, mb.targets[:, None]).squeeze(-1)
        return TokenForward(logp, -(logp_all.exp() * logp_all).sum(-1))

    with torch.no_grad():  # on-policy: the behaviour logprobs are the model's own
        chunk.old_logprobs = [0.0] * len(MASK)
        own = forward(mb).logprobs
        it = iter(own.tolist())
        chunk.old_logprobs = [next(it) if m else 0.0 for m in MASK]
    algo = AlgoConfig(aggregation="budget", entropy_coef=0.0)
    phi = 8
    forward_backward(forward, [collate([chunk])], algo, StepCounts.from_sequence_lengths([5], token_budget=phi))
    grad = model.logits.grad
    p = len(s.prompt_ids)
    # row p + j - 1 predicts response token j: observation tokens are j = 3, 4
    for j in (3, 4):
        assert torch.equal(grad[p + j - 1], torch.zeros_like(grad[p + j - 1]))
    # each model token's row, by hand in float64: loss = -(1/phi) * sum_t A * ratio_t, with
    # ratio_t = exp(logp_t - old_t) (1 up to the float32 the behaviour logprobs travel in, so
    # unclipped), d ratio_t / d logits = ratio_t * (onehot(y) - softmax(row))
    old = iter(collate([chunk]).old_logprobs.double().tolist())
    with torch.no_grad():
        for j, m in enumerate(MASK):
            if not m:
                continue
            row = model.logits[p + j - 1]
            ratio = torch.exp(torch.log_softmax(row, -1)[s.response_ids[j]] - next(old))
            expected = -(0.75 / phi) * ratio * (torch.nn.functional.one_hot(torch.tensor(s.response_ids[j]), 11).double()
                                               - torch.softmax(row, -1))
            torch.testing.assert_close(grad[p + j - 1], expected, atol=1e-15, rtol=1e-12)
    assert int((grad.abs().sum(-1) > 0).sum()) == 5  # the five model tokens' rows, nothing else
