"""Held-out evaluation metrics from n samples per prompt: avg@n and pass@k.

- avg@n: the mean reward over every sample of every prompt (for 0/1 rewards, the accuracy of
  one sample, pass@1).
- pass@k: the probability that at least one of k samples drawn without replacement from a
  prompt's n is correct, averaged over prompts, with the unbiased estimator of Chen et al. (2021,
  "Evaluating Large Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k) for c correct of
  n. A sample is correct when its reward is at least `threshold`.
"""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with c correct samples out of n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(rewards_by_prompt: list[list[float]], n: int, ks: list[int],
                 threshold: float = 1.0) -> dict[str, float]:
    """`avg@{n}` and `pass@{k}` for each k over prompts that have all n rewards (a prompt with
    fewer, e.g. one lost with its actor, would bias pass@k; it is left out and counted)."""
    complete = [r for r in rewards_by_prompt if len(r) == n]
    if not complete:
        raise ValueError(f"no prompt has all {n} samples scored")
    out = {f"avg@{n}": sum(map(sum, complete)) / (n * len(complete))}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(x >= threshold for x in r), k) for r in complete) / len(complete)
    out["num_prompts"] = len(complete)
    out["num_incomplete"] = len(rewards_by_prompt) - len(complete)
    return out
