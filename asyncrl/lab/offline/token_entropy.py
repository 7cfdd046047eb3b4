"""A policy's token entropy on sampled responses, computed the way the learner computes
`entropy/learner`: a transformers forward over prompt + response, the final hidden states of the
response positions, the LM head applied in chunks with the logits divided by the sampling
temperature (algo/token_stats.py), H_t over the whole vocabulary, averaged over all response
tokens (token mean). The same pass gives each sampled token's logprob, which must equal the
behaviour logprob vLLM reported for it: the gap is returned as a check that the engine really
held this policy (`asyncrl choose-checkpoint` prints it). With rollout.top_p < 1 vLLM's logprobs
are those of the truncated distribution and the gap is no longer near zero; the entropy here is
still the full distribution's, as the learner's is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.algo.token_stats import token_logprobs_and_entropy_from_hidden


@dataclass
class EntropyStats:
    mean_entropy: float
    """Token mean of H_t (nats) over every response token."""
    mean_nll: float
    """Token mean of -log pi(sampled token) from the engine's behaviour logprobs."""
    num_tokens: int
    max_logprob_gap: float
    """max |transformers logprob - engine logprob| over the sampled tokens."""


def load_policy(policy_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()


@torch.no_grad()
def response_entropy(model: torch.nn.Module, samples, temperature: float, chunk: int = 1024) -> EntropyStats:
    """`samples`: objects with prompt_ids, token_ids and logprobs (eval_policy.EvalSample), each
    forwarded alone (no padding to get wrong; the offline tools' sample counts are small)."""
    head = model.get_output_embeddings()
    entropy_sum, nll_sum, count, gap = 0.0, 0.0, 0, 0.0
    for s in samples:
        if not s.token_ids:
            continue
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        out = model(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
        # position t predicts token t + 1: the response tokens are predicted from len(prompt) - 1 on
        start = len(s.prompt_ids) - 1
        hidden = out.hidden_states[-1][0, start:start + len(s.token_ids)]
        logp, entropy = token_logprobs_and_entropy_from_hidden(
            hidden, head.weight, torch.tensor(s.token_ids), temperature, chunk, getattr(head, "bias", None))
        entropy_sum += entropy.double().sum().item()
        nll_sum -= sum(s.logprobs)
        count += len(s.token_ids)
        gap = max(gap, (logp.double() - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max().item())
    if count == 0:
        raise ValueError("no response tokens to measure the entropy on")
    return EntropyStats(entropy_sum / count, nll_sum / count, count, gap)
