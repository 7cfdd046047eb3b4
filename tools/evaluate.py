"""Evaluate a policy on held-out data: avg@n and pass@k, overall and per data_source.

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

NUM_EXAMPLES = 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="policy directory (or builtin:tiny)")
    p.add_argument("--config", default=None, help="config YAML (default: the run's config.yaml)")
    p.add_argument("--data", default=None, help="held-out jsonl (default: the run's held-out data)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default: eval.n)")
    p.add_argument("--k", type=int, nargs="+", default=None,
                   help="k values of pass@k (default: eval.pass_k, else 1 and n)")
    p.add_argument("--max-prompts", type=int, default=None, help="first this many records (default: eval.max_prompts)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (default: eval.temperature, else the last stage's)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--out", default=None, help="write every sample (prompt, response, reward, outcome) as jsonl")
    p.add_argument("--json", action="store_true", help="print one JSON line only")
    return p.parse_args(argv)


def say(text: str) -> None:
    """Progress goes to stderr, so --json leaves stdout to its one line."""
    print(text, file=sys.stderr, flush=True)


def evaluate(args: argparse.Namespace) -> dict:
    from asyncrl.config import ConfigError
    from asyncrl.data.stages import resolve_stages
    from asyncrl.eval_policy import held_out_records, load_run_config, sample_and_score, summarize
    from asyncrl.rollout.engine import SamplingSpec

    cfg, config_path = load_run_config(args.model, args.config, say)
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
            "data": args.data or cfg.eval.data or f"{cfg.data.type} held-out split",
            "n": n, "temperature": temperature, "max_tokens": spec.max_tokens, "num_records": len(records),
            **summarize(samples, n, ks), "examples": examples}


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
    try:
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
