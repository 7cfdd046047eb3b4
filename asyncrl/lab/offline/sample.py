"""A policy sampled once on each of some prompts of its run's data, with the accuracy (the mean
reward of the run's verifiers): a quick look at what a saved policy does (`asyncrl sample`). For
avg@n and pass@k use evaluate.py.

The prompts are drawn from the held-out records of the run the policy belongs to (its config.yaml,
found as evaluate.py finds it), else from the run's training data."""

from __future__ import annotations

import random
import sys
from typing import Any

NUM_EXAMPLES = 5


def draw(records: list[dict[str, Any]], num: int, seed: int) -> list[dict[str, Any]]:
    """`num` records in a seeded order, each once before any repeats."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[order[i % len(order)]] for i in range(num)]


def sample_policy(model: str, num: int, temperature: float, max_tokens: int, seed: int) -> dict[str, Any]:
    """One sample on each of `num` drawn prompts, scored: accuracy, mean length and a few examples."""
    import asyncio

    from asyncrl.lab.offline.eval_policy import held_out_records, load_run_config, sample_and_score, train_records
    from asyncrl.rollout.engine import SamplingSpec

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    cfg, _ = load_run_config(model, say=say)
    records = held_out_records(cfg)
    split = "held-out"
    if records is None:
        records, split = train_records(cfg), "training"
    spec = SamplingSpec(temperature, cfg.rollout.top_p, max_tokens, seed=seed)
    samples = asyncio.run(sample_and_score(cfg, draw(records, num, seed), 1, spec, say))
    return {
        "model": model, "num_samples": len(samples), "temperature": temperature, "split": split,
        "accuracy": sum(s.reward for s in samples) / len(samples),
        "mean_response_tokens": sum(s.num_tokens for s in samples) / len(samples),
        "examples": [f"{s.prompt}{s.response}" for s in samples[:NUM_EXAMPLES]],
    }
