"""`asyncrl sample --model runs/tiny-cpu/final --num 64`: load a policy (a run's `final/`, a
checkpoint's `learner/policy/`, or any HF model dir) in vLLM and sample from it on its run's data
(asyncrl/lab/offline/sample.py); prints a few completions and the accuracy, or with --json one
machine-readable line. For avg@n and pass@k use `asyncrl evaluate`.
"""

from __future__ import annotations

import argparse
import json

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
    from asyncrl.cli.engine_work import run_engine_work
    from asyncrl.lab.offline.sample import sample_policy

    result = run_engine_work(lambda: sample_policy(args.model, args.num, args.temperature, args.max_tokens, args.seed))
    if result is None:
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    for ex in result["examples"]:
        print("  ", ex)
    print(f"accuracy at T={args.temperature}: {result['accuracy']:.3f} over {result['num_samples']} "
          f"{result['split']} prompts")
    return 0
