"""Offline difficulty filter: drop the prompts the initial policy always or never solves.

    python tools/filter_difficulty.py --config my.yaml --out train.filtered.jsonl
    python tools/filter_difficulty.py --model builtin:tiny --n 16 --out tiny.filtered.jsonl
    python tools/filter_difficulty.py --config my.yaml --data more.jsonl --min-rate 0.1 --max-rate 0.9 --out f.jsonl

Each prompt of the training data (the config's data section, or --data with the same field names)
is sampled --n times from the initial policy (--model, default the config's model.path) at the
first stage's temperature and max_tokens, as the run's first rollouts would be, through one vLLM
engine, and scored by the run's verifiers (the path tools/evaluate.py uses). Its pass rate is
the fraction of samples with reward >= 1; a prompt is kept when --min-rate < rate < --max-rate
(default 0 and 1: drop the never and the always solved, as Skywork-OR1 and Ring-lite do; the rule
is asyncrl/offline/difficulty.py). The kept records are written to --out as they were in the
input (every field), plus `pass_rate`, so `data.type: jsonl, data.path: <out>` loads them with
the same field settings. Prompts too long for the context are dropped and counted. Exit codes:
0 done, 2 bad arguments, config or data.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

RATE_FIELD = "pass_rate"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def input_records(cfg, data: str | None, max_prompts: int | None) -> tuple[list[dict], list[dict]]:
    """(records as the run reads them, the same records as written in the input file), in one order."""
    import functools

    from asyncrl.data.build import load_records
    from asyncrl.data.records import iter_jsonl
    from asyncrl.reward.registry import route

    path = data or (cfg.data.path if cfg.data.type == "jsonl" else None)
    records = load_records(cfg.data, functools.partial(route, cfg.reward), path=data)[:max_prompts]
    raw = [rec for _, rec in iter_jsonl(path, len(records))] if path else [dict(r) for r in records]
    return records, raw


async def measure(args: argparse.Namespace, engine: Any = None) -> dict[str, Any]:
    """Sample, score, apply the rule and write --out; returns the counts and the pass rates."""
    from asyncrl.config import ConfigError, load_config
    from asyncrl.data.stages import resolve_stages
    from asyncrl.eval_policy import load_run_config, sample_and_score
    from asyncrl.offline.difficulty import DifficultyRule, apply_rule
    from asyncrl.rollout.engine import SamplingSpec

    try:
        rule = DifficultyRule(args.min_rate, args.max_rate)
    except ValueError as e:
        raise ConfigError(f"--min-rate / --max-rate: {e}") from None
    if args.n < 1:
        raise ConfigError(f"--n must be at least 1, got {args.n}")
    model = args.model or load_config(Path(args.config) if args.config else None).model.path
    cfg, _ = load_run_config(model, args.config, say)
    records, raw = input_records(cfg, args.data, args.max_prompts)
    stage = resolve_stages(cfg)[0]  # the policy is about to start the first stage
    spec = SamplingSpec(args.temperature or stage.temperature, cfg.rollout.top_p,
                        args.max_tokens or stage.max_tokens, seed=cfg.seed)
    say(f"measuring {cfg.model.path}: {len(records)} prompts x {args.n} samples at T={spec.temperature}")
    if engine is not None:
        await engine.load(cfg.model.path)
    samples = await sample_and_score(cfg, records, args.n, spec, say, engine)
    rewards: dict[int, list[float]] = {}
    for s in samples:
        rewards.setdefault(s.record_index, []).append(s.reward)
    result = apply_rule(len(records), rewards, rule)
    with open(args.out, "w", encoding="utf-8") as f:
        for i in result.kept():
            f.write(json.dumps({**raw[i], RATE_FIELD: result.rates[i]}) + "\n")
    return {"model": cfg.model.path, "n": args.n, "temperature": spec.temperature, "out": args.out,
            "num_records": len(records), **result.counts(), "pass_rates": result.rates}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.config import ConfigError

    hide_broken_torch_extras()  # before transformers and vLLM load
    try:
        r = asyncio.run(measure(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rates = sorted(r["pass_rates"].values())
    mean = sum(rates) / len(rates) if rates else float("nan")
    print(f"kept {r['kept']} of {r['num_records']} prompts -> {r['out']}; dropped {r['too_hard']} never solved "
          f"(rate <= {args.min_rate:g}), {r['too_easy']} always solved (rate >= {args.max_rate:g}), "
          f"{r['too_long']} too long for the context; mean pass rate {mean:.3f} over {args.n} samples at "
          f"T={r['temperature']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
