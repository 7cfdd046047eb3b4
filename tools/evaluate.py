"""Evaluate policies on held-out data: avg@n and pass@k, overall and per data_source.

    python tools/evaluate.py runs/tiny-cpu                  # final/ and every checkpoint -> runs/tiny-cpu/eval.json
    python tools/evaluate.py runs/study/*-s0 --final-only   # several runs, one vLLM engine for all
    python tools/evaluate.py --model runs/tiny-cpu/final
    python tools/evaluate.py --model runs/tiny-cpu/checkpoints/step_100/learner/policy --n 16 --k 1 4 16
    python tools/evaluate.py --model some/hf/model --config configs/my_recipe.yaml --data held_out.jsonl

The policy is a run's `final/`, a checkpoint's `learner/policy/`, any Hugging Face model directory
or `builtin:tiny` (the untrained start). Its run's config.yaml (found from the path; --config
overrides; neither: the default config) gives the data fields, the verifiers and their timeouts,
the context length and the sampling defaults. The data is --data (same field names as the run's
data section), else the run's held-out set: eval.data, or the built-in task's held-out split.
Sampling defaults to the run's eval settings (eval.n, eval.pass_k, eval.temperature, else the last
stage's temperature and max_tokens). Exit codes: 0 done, 2 bad arguments, config or data.

Run directories (positional): every saved policy of each run (asyncrl/offline/run_policies.py:
checkpoints/step_N/learner/policy oldest first, then final/) is evaluated with the run's
config.yaml and written to <run>/eval.json, one entry per policy (step, avg@n, pass@k, per data
source), with a table on stderr. One vLLM engine serves every policy of every run given: each
later policy's weights are pushed into it over the run's gloo weight sync (offline/policy_engine.py),
a new engine starting only for a policy of another architecture. Policies already in eval.json
with the same settings are kept, not evaluated again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from asyncrl.rollout.engine import SamplingSpec

NUM_EXAMPLES = 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", help="run directories: evaluate final/ and every checkpoint, write eval.json")
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


def say(text: str) -> None:
    """Progress goes to stderr, so --json leaves stdout to its one line."""
    print(text, file=sys.stderr, flush=True)


def setup(cfg, args: argparse.Namespace) -> tuple[list[dict], int, list[int], SamplingSpec, dict]:
    """Records, n, the k values, the sampling spec and the settings (what makes two evaluations
    comparable) of an evaluation under the run's config and the arguments."""
    from asyncrl.config import ConfigError
    from asyncrl.data.stages import resolve_stages
    from asyncrl.eval_policy import held_out_records

    n = cfg.eval.n if args.n is None else args.n
    ks = args.k or cfg.eval.pass_k or sorted({1, n})
    if n < 1 or any(not 1 <= k <= n for k in ks):
        raise ConfigError(f"--k: every k must be between 1 and --n ({n}), got {ks}")
    records = held_out_records(cfg, args.data, args.max_prompts)
    if records is None:
        raise ConfigError("the run has no held-out data (jsonl data without eval.data); pass --data file.jsonl")
    stage = resolve_stages(cfg)[-1]  # the policy was trained last in the last stage
    temperature = args.temperature if args.temperature is not None else cfg.eval.temperature or stage.temperature
    spec = SamplingSpec(temperature, cfg.rollout.top_p, args.max_tokens or stage.max_tokens, seed=cfg.seed)
    settings = {"data": args.data or cfg.eval.data or f"{cfg.data.type} held-out split", "num_records": len(records),
                "n": n, "ks": ks, "temperature": temperature, "max_tokens": spec.max_tokens, "seed": cfg.seed}
    return records, n, ks, spec, settings


def evaluate(args: argparse.Namespace) -> dict:
    from asyncrl.eval_policy import load_run_config, sample_and_score, summarize

    cfg, config_path = load_run_config(args.model, args.config, say)
    records, n, ks, spec, settings = setup(cfg, args)
    temperature = spec.temperature
    say(f"evaluating {cfg.model.path}: {len(records)} prompts x {n} samples at T={temperature}")
    samples = asyncio.run(sample_and_score(cfg, records, n, spec, say))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps({"record": s.record_index, "data_source": s.data_source, "prompt": s.prompt,
                                    "response": s.response, "reward": s.reward, "outcome": s.outcome,
                                    "finish_reason": s.finish_reason}) + "\n")
    examples = [f"{str(s.prompt)[-200:]} -> {s.response}  (reward {s.reward:g}, {s.outcome})"
                for s in samples[::n][:NUM_EXAMPLES]]
    return {"model": args.model, "config": str(config_path) if config_path else None,
            "data": settings["data"], "n": n, "temperature": temperature, "max_tokens": spec.max_tokens, "num_records": len(records),
            **summarize(samples, n, ks), "examples": examples}


async def evaluate_runs(args: argparse.Namespace, engine=None) -> list[Path]:
    """Every saved policy of each run in args.runs into its eval.json, one engine for all (`engine`:
    a PolicyEngine to use and leave running); the paths written. A run with no saved policy is
    named and skipped."""
    from asyncrl.config import ConfigError
    from asyncrl.eval_policy import load_run_config, reward_pool, sample_and_score, summarize
    from asyncrl.offline.policy_engine import PolicyEngine
    from asyncrl.offline.run_policies import (
        EVAL_FILE, eval_document, eval_entry, figures_table, read_eval, reusable, run_policies)

    own, written = engine is None, []
    try:
        for run in map(Path, args.runs):
            policies = run_policies(run, args.final_only)
            if not policies:
                say(f"{run}: no saved policy (final/ or checkpoints/step_N/learner/policy), skipped")
                continue
            cfg, _ = load_run_config(str(policies[-1].path), args.config, say)
            records, n, ks, spec, settings = setup(cfg, args)
            kept = reusable(read_eval(run), settings)
            todo = [p for p in policies if (p.name, p.step) not in kept]
            say(f"{run}: {len(todo)} of {len(policies)} policies to evaluate ({len(records)} prompts x {n} "
                f"samples at T={spec.temperature})")
            entries = []
            if todo:
                engine = engine or PolicyEngine(cfg, say)
                pool = reward_pool(cfg, records)
                try:
                    for policy in todo:
                        await engine.load(policy.path)
                        policy_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(policy.path)})})
                        samples = await sample_and_score(policy_cfg, records, n, spec, say, engine, pool)
                        entries.append(eval_entry(policy, summarize(samples, n, ks)))
                finally:
                    pool.close()
            doc = eval_document(run, settings, entries, kept)
            (run / EVAL_FILE).write_text(json.dumps(doc, indent=1))
            written.append(run / EVAL_FILE)
            say(f"{run / EVAL_FILE}:\n{figures_table(doc['policies'])}")
    finally:
        if own and engine is not None:
            say(f"vLLM engines started: {engine.num_engines}")
            await engine.shutdown()
    if not written:
        raise ConfigError(f"none of {', '.join(args.runs)} holds a saved policy")
    return written


def report(r: dict) -> None:
    n = r["n"]

    def figures(m: dict) -> str:
        return "  ".join(f"{key} {m[key]:.3f}" for key in m if key.startswith(("avg@", "pass@")))

    print(f"policy {r['model']} (config: {r['config'] or 'default'})")
    print(f"data: {r['data']}, {n} samples per prompt at T={r['temperature']}, max {r['max_tokens']} tokens")
    print("examples:")
    for ex in r["examples"]:
        print("  ", ex)
    skipped = r["num_records"] - r["num_prompts"]
    print(f"{figures(r)}  over {r['num_prompts']} prompts" + (f" ({skipped} too long, left out)" if skipped else ""))
    for source, m in r["by_source"].items():
        print(f"  {source}: {figures(m)}  ({m['num_prompts']} prompts)")
    outcomes = ", ".join(f"{k} {v}" for k, v in r["outcomes"].items())
    print(f"mean response {r['mean_response_tokens']:.1f} tokens; outcomes: {outcomes}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.config import ConfigError

    hide_broken_torch_extras()  # before transformers and vLLM load
    if bool(args.model) == bool(args.runs):
        print("error: give run directories or --model (one policy), not both or neither", file=sys.stderr)
        return 2
    try:
        if args.runs:
            for path in asyncio.run(evaluate_runs(args)):
                print(path)
            return 0
        result = evaluate(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
