"""Load a policy (a run's `final/`, a checkpoint's `learner/policy/`, or any HF model dir) in vLLM
and sample from it on its run's data.

    python tools/sample_policy.py --model runs/tiny-cpu/final --num 64

One sample for each of `--num` prompts drawn from the held-out records of the run the model
belongs to (its config.yaml, as tools/evaluate.py finds it), else from the run's training data;
prints a few completions and the accuracy (the mean reward of the run's verifiers) at the given
temperature. `--json` prints one machine-readable line. For avg@n and pass@k use tools/evaluate.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from typing import Any


def draw(records: list[dict[str, Any]], num: int, seed: int) -> list[dict[str, Any]]:
    """`num` records in a seeded order, each once before any repeats."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[order[i % len(order)]] for i in range(num)]


def sample(model: str, num: int, temperature: float, max_tokens: int, seed: int) -> dict:
    from asyncrl.eval_policy import held_out_records, load_run_config, sample_and_score, train_records
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
        "examples": [f"{s.prompt}{s.response}" for s in samples[:5]],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line only")
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.config import ConfigError

    hide_broken_torch_extras()  # before transformers and vLLM load
    try:
        result = sample(args.model, args.num, args.temperature, args.max_tokens, args.seed)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    for ex in result["examples"]:
        print("  ", ex)
    print(f"accuracy at T={args.temperature}: {result['accuracy']:.3f} over {result['num_samples']} "
          f"{result['split']} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
