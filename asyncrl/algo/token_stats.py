"""Token logprobs and entropies over the vocabulary, computed in chunks of tokens (pure torch).

H_t = -sum_v pi(v | s_t) log pi(v | s_t) (the entropy bonus and control term). Logits are divided by the
sampling temperature first so the learner scores the same distribution the actors sampled from.

`token_logprobs_and_entropy` takes the selected loss positions' logits [T, V] and takes the
log-softmax `chunk` rows at a time, so the [T, V] float32 log-softmax of the whole batch never
exists at once besides the logits themselves. `token_logprobs_and_entropy_from_hidden` goes one
step further: it takes the final hidden states [T, H] and the LM-head weight [V, H] and forms the
logits chunk by chunk, so no [T, V] tensor exists at all. When gradients are needed each chunk
of either function runs under activation checkpointing: autograd keeps only the chunk's inputs,
and the chunk's log-softmax (and logits) are recomputed during backward, one chunk at a time.

`recompute=False` (the hidden-state function) evaluates the head once instead: each chunk keeps
its [chunk, V] log-softmax for backward (`_HeadChunk`, T x V floats over the micro-batch, where
checkpointing keeps none) and its backward applies the gradients of log pi(a) and H in closed
form, with u the tempered logits, p = softmax(u) and g the incoming gradients:

    d log p_a / d u_j = [j = a] - p_j          d H / d u_j = -p_j (log p_j + H)
    g_u = g_logp ([j = a] - p) - g_H p (log p + H),   g_z = g_u / temperature

then the head's two matmuls (hidden's and the weight's gradients). A checkpointed chunk runs the
head's matmul three times (forward, its recomputation, two in backward: four in all); this one three.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V], targets [T] int -> (logprob of target [T], entropy H_t [T]), float32."""
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {targets.shape[0]} targets")
    # Under autograd each chunk is checkpointed too: otherwise every chunk's log-softmax and
    # exp stay saved for backward, and together they are the [T, V] tensors chunking avoids.
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    logps, ents = [], []
    # split, not slicing: backward then concatenates the chunks' gradients once, instead of
    # materializing a zero-padded [T, V] gradient per chunk
    for rows, rows_targets in zip(logits.split(chunk), targets.split(chunk)):
        args = (rows, rows_targets, temperature)
        if needs_grad:
            logp, ent = checkpoint(_logits_chunk_stats, *args, use_reentrant=False)
        else:
            logp, ent = _logits_chunk_stats(*args)
        logps.append(logp)
        ents.append(ent)
    if not logps:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


def token_logprobs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk: int = 1024,
    lm_head_bias: torch.Tensor | None = None,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H], lm_head_weight [V, H], targets [T] int -> (logprob [T], entropy [T]).

    `temperature` is one float or one per token [T] (responses sampled at different temperatures).

    Results are in float32, or float64 when the inputs are float64. With `recompute` (the
    default), peak extra memory is a few [chunk, V] tensors, forward and backward, instead of
    several [T, V] ones; without it, one [T, V] log-softmax is kept for backward and the head is
    not evaluated again there (module docstring).
    """
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows for {targets.shape[0]} targets")
    if hidden.shape[-1] != lm_head_weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} vs LM head {tuple(lm_head_weight.shape)}")
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=dtype)
        return empty, empty
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, lm_head_weight, lm_head_bias)
    )
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk):
        temp = temperature[start : start + chunk, None] if torch.is_tensor(temperature) else temperature
        args = (hidden[start : start + chunk], lm_head_weight, lm_head_bias,
                targets[start : start + chunk], temp, dtype)
        if needs_grad and recompute:
            logp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False)
        elif needs_grad:
            logp, ent = _HeadChunk.apply(*args)
        else:
            logp, ent = _chunk_stats(*args)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def _logits_chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [chunk, V]
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _chunk_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).to(dtype) / temperature  # [chunk, V]; temperature scalar or [chunk, 1]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class _HeadChunk(torch.autograd.Function):
    """`_chunk_stats` with its backward in closed form from the saved log-softmax (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, dtype):
        logits = F.linear(hidden, weight, bias).to(dtype) / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, logp_all, targets, entropy,
                              temperature if torch.is_tensor(temperature) else None)
        ctx.temperature, ctx.has_bias = temperature, bias is not None
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, logp_all, targets, entropy, temps = ctx.saved_tensors
        temperature = temps if temps is not None else ctx.temperature
        p = logp_all.exp()
        g_u = -p * (g_logp[:, None] + g_entropy[:, None] * (logp_all + entropy[:, None]))
        g_u.scatter_add_(-1, targets[:, None], g_logp[:, None])
        g_z = g_u / temperature
        g_hidden = (g_z.to(weight.dtype) @ weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        g_weight = (g_z.T.to(hidden.dtype) @ hidden).to(weight.dtype) if ctx.needs_input_grad[1] else None
        g_bias = g_z.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return g_hidden, g_weight, g_bias, None, None, None
