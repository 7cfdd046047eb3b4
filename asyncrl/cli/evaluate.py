"""`asyncrl evaluate`: policies on held-out data, avg@n and pass@k (asyncrl/lab/offline/evaluate.py).

    asyncrl evaluate runs/tiny-cpu                  # start, every checkpoint, final/ -> runs/tiny-cpu/eval.json
    asyncrl evaluate runs/study/*-s0 --final-only   # several runs, one vLLM engine for all
    asyncrl evaluate --model runs/tiny-cpu/final
    asyncrl evaluate --model runs/tiny-cpu/checkpoints/step_100/learner/policy --n 16 --k 1 4 16
    asyncrl evaluate --model some/hf/model --config configs/my_recipe.yaml --data held_out.jsonl

Exit codes: 0 done, 2 bad arguments, config or data.
"""

from __future__ import annotations

import argparse
import json
import sys

SUMMARY = "avg@n and pass@k of a run's saved policies (-> eval.json) or of one policy"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*",
                   help="run directories: evaluate the start (model.path), every checkpoint and final/, write eval.json")
    p.add_argument("--model", default=None, help="one policy directory (or builtin:tiny) instead of runs")
    p.add_argument("--final-only", action="store_true", help="with run directories: final/ only")
    p.add_argument("--config", default=None, help="config YAML (default: the run's config.yaml)")
    p.add_argument("--data", default=None, help="held-out jsonl (default: the run's held-out data)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default: eval.n)")
    p.add_argument("--k", type=int, nargs="+", default=None,
                   help="k values of pass@k (default: eval.pass_k, else 1 and n)")
    p.add_argument("--max-prompts", type=int, default=None, help="first this many records (default: eval.max_prompts)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (default: eval.temperature, else the last stage's)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--out", default=None, help="with --model: write every sample (prompt, response, reward, outcome) as jsonl")
    p.add_argument("--json", action="store_true", help="with --model: print one JSON line only")
    return p.parse_args(argv)


def options(args: argparse.Namespace):
    """The EvalOptions the arguments give."""
    from asyncrl.lab.offline.evaluate import EvalOptions

    return EvalOptions(config=args.config, data=args.data, n=args.n, ks=args.k or [], max_prompts=args.max_prompts,
                       temperature=args.temperature, max_tokens=args.max_tokens, final_only=args.final_only)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if bool(args.model) == bool(args.runs):
        print("error: give run directories or --model (one policy), not both or neither", file=sys.stderr)
        return 2
    import asyncio

    from asyncrl.cli.engine_work import run_engine_work
    from asyncrl.lab.offline.evaluate import evaluate_model, evaluate_runs, model_report

    if args.runs:
        paths = run_engine_work(lambda: asyncio.run(evaluate_runs(args.runs, options(args))))
        for path in paths or []:
            print(path)
        return 0 if paths is not None else 2
    result = run_engine_work(lambda: asyncio.run(evaluate_model(args.model, options(args), args.out)))
    if result is None:
        return 2
    print(json.dumps(result) if args.json else model_report(result))
    return 0
