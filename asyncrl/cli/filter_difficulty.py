"""`asyncrl filter-difficulty`: drop the prompts the initial policy always or never solves
(asyncrl/lab/offline/difficulty_filter.py says how).

    asyncrl filter-difficulty --config my.yaml --out train.filtered.jsonl
    asyncrl filter-difficulty --model builtin:tiny --n 16 --out tiny.filtered.jsonl
    asyncrl filter-difficulty --config my.yaml --data more.jsonl --min-rate 0.1 --max-rate 0.9 --out f.jsonl

Exit codes: 0 done, 2 bad arguments, config or data.
"""

from __future__ import annotations

import argparse

SUMMARY = "drop the prompts the initial policy always or never solves"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl filter-difficulty", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="jsonl of the kept records, each with its pass_rate")
    p.add_argument("--model", default=None, help="the initial policy (default: the config's model.path)")
    p.add_argument("--config", default=None, help="recipe: data fields, verifiers, sampling (default: the default config)")
    p.add_argument("--data", default=None, help="jsonl to filter (default: the config's training data)")
    p.add_argument("--n", type=int, default=16, help="samples per prompt (Skywork-OR1: 16 for math, 8 for code)")
    p.add_argument("--min-rate", type=float, default=0.0, help="drop a pass rate at or below this (default 0)")
    p.add_argument("--max-rate", type=float, default=1.0, help="drop a pass rate at or above this (default 1)")
    p.add_argument("--temperature", type=float, default=None, help="default: the first stage's")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the first stage's")
    p.add_argument("--max-prompts", type=int, default=None, help="only the first this many records")
    return p.parse_args(argv)


def measure(args: argparse.Namespace, engine=None):
    """The filter with the arguments' settings (a coroutine; `engine`: a started PolicyEngine)."""
    from asyncrl.config import ConfigError
    from asyncrl.lab.offline.difficulty import DifficultyRule
    from asyncrl.lab.offline.difficulty_filter import filter_by_difficulty

    try:
        rule = DifficultyRule(args.min_rate, args.max_rate)
    except ValueError as e:
        raise ConfigError(f"--min-rate / --max-rate: {e}") from None
    return filter_by_difficulty(args.out, rule, args.n, args.model, args.config, args.data, args.max_prompts,
                                args.temperature, args.max_tokens, engine)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import asyncio

    from asyncrl.cli.engine_work import run_engine_work

    r = run_engine_work(lambda: asyncio.run(measure(args)))
    if r is None:
        return 2
    rates = sorted(r["pass_rates"].values())
    mean = sum(rates) / len(rates) if rates else float("nan")
    print(f"kept {r['kept']} of {r['num_records']} prompts -> {r['out']}; dropped {r['too_hard']} never solved "
          f"(rate <= {args.min_rate:g}), {r['too_easy']} always solved (rate >= {args.max_rate:g}), "
          f"{r['too_long']} too long for the context; mean pass rate {mean:.3f} over {args.n} samples at "
          f"T={r['temperature']}")
    return 0
