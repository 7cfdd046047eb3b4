"""How far a bf16 learner's logprobs are from its own float32 ones: the floor under any logprob
parity check between a bf16 learner and bf16 engines (`sync.probe_tolerance`).

The parity probe (orchestrator/weight_sync.py) scores a sample on the learner and on every
engine and takes the largest per-token gap. In float32 both sides agree to rounding (1e-4 holds
with a wide margin); in bf16 each side rounds the logits its own way (other kernels, other
summation orders), so the two can be as far apart as each one's gap to float32 added up.
`bf16_gaps` measures that gap on the learner's side: the sequence scored teacher-forced, once in
float32 and once under bf16 autocast with the model's own head (as `LearnerRank.prompt_logprobs`
scores the probe, and as engines compute bf16 logits).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def bf16_gaps(model: torch.nn.Module, sequences: list[list[int]], device: torch.device) -> dict[str, float]:
    """|log p_bf16 - log p_fp32| per scored token over `sequences` (each token given the ones
    before it): max, 99th percentile and mean, and how many tokens were scored."""
    gaps = []
    for ids in sequences:
        x = torch.tensor([ids], device=device)
        target = x[0, 1:, None]
        exact = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), -1).gather(-1, target)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=x).logits[0, :-1]
        got = torch.log_softmax(logits.double(), -1).gather(-1, target)
        gaps.append((got - exact).abs().flatten())
    every = torch.cat(gaps)
    return {"max_abs": float(every.max()), "p99_abs": float(every.quantile(0.99)),
            "mean_abs": float(every.mean()), "tokens": int(every.numel())}
