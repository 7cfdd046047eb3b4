"""`asyncrl sample --model runs/tiny-cpu/final --num 64`: load a policy (a run's `final/`, a
checkpoint's `learner/policy/`, or any HF model dir) in vLLM and sample from it on its run's data
(asyncrl/lab/offline/sample.py); prints a few completions and the accuracy, or with --json one
machine-readable line. For avg@n and pass@k use `asyncrl evaluate`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SUMMARY = "a policy's samples on a few prompts of its run's data, and its accuracy"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl sample", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line only")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.config import ConfigError
    from asyncrl.lab.offline.sample import sample_policy

    hide_broken_torch_extras()  # before transformers and vLLM load
    try:
        result = sample_policy(args.model, args.num, args.temperature, args.max_tokens, args.seed)
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
