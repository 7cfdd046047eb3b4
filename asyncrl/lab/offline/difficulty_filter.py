"""The offline difficulty filter: drop the prompts the initial policy always or never solves
(`asyncrl filter-difficulty`; the rule is difficulty.py).

Each prompt of the training data (the config's data section, or `data` with the same field names)
is sampled n times from the initial policy (`model`, default the config's model.path) at the first
stage's temperature and max_tokens, as the run's first rollouts would be, through one vLLM engine,
and scored by the run's verifiers (the path evaluate.py uses). Its pass rate is the fraction of
samples with reward >= 1; a prompt is kept when min_rate < rate < max_rate (default 0 and 1: drop
the never and the always solved, as Skywork-OR1 and Ring-lite do). The kept records are written
to `out` as they were in the input (every field), plus `pass_rate`, so `data.type: jsonl,
data.path: <out>` loads them with the same field settings. Prompts too long for the context are
dropped and counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError
from asyncrl.lab.offline.difficulty import DifficultyRule, apply_rule

RATE_FIELD = "pass_rate"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def input_records(cfg: Config, data: str | None, max_prompts: int | None) -> tuple[list[dict], list[dict]]:
    """(records as the run reads them, the same records as written in the input file), in one order."""
    import functools

    from asyncrl.data.build import load_records
    from asyncrl.data.records import iter_jsonl
    from asyncrl.reward.registry import route

    path = data or (cfg.data.path if cfg.data.type == "jsonl" else None)
    records = load_records(cfg.data, functools.partial(route, cfg.reward), path=data)[:max_prompts]
    raw = [rec for _, rec in iter_jsonl(path, len(records))] if path else [dict(r) for r in records]
    return records, raw


async def filter_by_difficulty(out: str | Path, rule: DifficultyRule, n: int = 16, model: str | None = None,
                               config: str | None = None, data: str | None = None, max_prompts: int | None = None,
                               temperature: float | None = None, max_tokens: int | None = None,
                               engine: Any = None) -> dict[str, Any]:
    """Sample, score, apply `rule` and write `out`; returns the counts and the pass rates.
    `engine`: a started PolicyEngine to load the model into (else one of its own)."""
    from asyncrl.config import load_config
    from asyncrl.data.stages import resolve_stages
    from asyncrl.lab.offline.eval_policy import load_run_config, sample_and_score
    from asyncrl.rollout.engine import SamplingSpec

    if n < 1:
        raise ConfigError(f"--n must be at least 1, got {n}")
    model = model or load_config(Path(config) if config else None).model.path
    cfg, _ = load_run_config(model, config, say)
    records, raw = input_records(cfg, data, max_prompts)
    stage = resolve_stages(cfg)[0]  # the policy is about to start the first stage
    spec = SamplingSpec(temperature or stage.temperature, cfg.rollout.top_p, max_tokens or stage.max_tokens,
                        seed=cfg.seed)
    say(f"measuring {cfg.model.path}: {len(records)} prompts x {n} samples at T={spec.temperature}")
    if engine is not None:
        await engine.load(cfg.model.path)
    samples = await sample_and_score(cfg, records, n, spec, say, engine)
    rewards: dict[int, list[float]] = {}
    for s in samples:
        rewards.setdefault(s.record_index, []).append(s.reward)
    result = apply_rule(len(records), rewards, rule)
    with open(out, "w", encoding="utf-8") as f:
        for i in result.kept():
            f.write(json.dumps({**raw[i], RATE_FIELD: result.rates[i]}) + "\n")
    return {"model": cfg.model.path, "n": n, "temperature": spec.temperature, "out": str(out),
            "num_records": len(records), **result.counts(), "pass_rates": result.rates}
