"""Evaluate saved policies on held-out data: avg@n and pass@k, overall and per data_source
(`asyncrl evaluate`).

The policy is a run's `final/`, a checkpoint's `learner/policy/`, any Hugging Face model directory
or `builtin:tiny` (the untrained start). Its run's config.yaml (found from the path; `config`
overrides; neither: the default config) gives the data fields, the verifiers and their timeouts,
the context length and the sampling defaults. The data is `data` (same field names as the run's
data section), else the run's held-out set: eval.data, or the built-in task's held-out split.
Sampling defaults to the run's eval settings (eval.n, eval.pass_k, eval.temperature, else the last
stage's temperature and max_tokens).

Run directories (evaluate_runs): the policy each run started from (its config.yaml's model.path,
as step 0) and every saved policy (run_policies.py: checkpoints/step_N/learner/policy oldest
first, then final/) is evaluated with the run's config.yaml and written to <run>/eval.json, one
entry per policy (step, avg@n, pass@k, per data source), with a table on stderr. A start whose
model is not on this machine (a hub id missing from the local cache, a relative directory given
from elsewhere) is named and skipped. One vLLM engine serves every policy of every run given: each
later policy's weights are pushed into it over the run's gloo weight sync (policy_engine.py), a
new engine starting only for a policy of another architecture. Policies already in eval.json with
the same settings are kept, not evaluated again, so a study (or a resumed run) costs only the new ones.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError
from asyncrl.lab.offline.run_policies import START, SavedPolicy
from asyncrl.rollout.engine import SamplingSpec

NUM_EXAMPLES = 5


@dataclass(frozen=True)
class EvalOptions:
    """What to evaluate on and how to sample; None: the run's own setting."""

    config: str | None = None
    """Config YAML (default: the run's config.yaml)."""
    data: str | None = None
    """Held-out jsonl (default: the run's held-out data)."""
    n: int | None = None
    """Samples per prompt (default: eval.n)."""
    ks: list[int] = field(default_factory=list)
    """k values of pass@k (default: eval.pass_k, else 1 and n)."""
    max_prompts: int | None = None
    temperature: float | None = None
    """0: greedy (default: eval.temperature, else the last stage's)."""
    max_tokens: int | None = None
    final_only: bool = False
    """With run directories: final/ only."""


def say(text: str) -> None:
    """Progress goes to stderr, so a JSON result leaves stdout to its one line."""
    print(text, file=sys.stderr, flush=True)


def setup(cfg: Config, opts: EvalOptions) -> tuple[list[dict], int, list[int], SamplingSpec, dict]:
    """Records, n, the k values, the sampling spec and the settings (what makes two evaluations
    comparable) of an evaluation under the run's config and the options."""
    from asyncrl.data.stages import resolve_stages
    from asyncrl.lab.offline.eval_policy import held_out_records

    n = cfg.eval.n if opts.n is None else opts.n
    ks = list(opts.ks) or cfg.eval.pass_k or sorted({1, n})
    if n < 1 or any(not 1 <= k <= n for k in ks):
        raise ConfigError(f"--k: every k must be between 1 and --n ({n}), got {ks}")
    records = held_out_records(cfg, opts.data, opts.max_prompts)
    if records is None:
        raise ConfigError("the run has no held-out data (jsonl data without eval.data); pass --data file.jsonl")
    stage = resolve_stages(cfg)[-1]  # the policy was trained last in the last stage
    temperature = opts.temperature if opts.temperature is not None else cfg.eval.temperature or stage.temperature
    spec = SamplingSpec(temperature, cfg.rollout.top_p, opts.max_tokens or stage.max_tokens, seed=cfg.seed)
    settings = {"data": opts.data or cfg.eval.data or f"{cfg.data.type} held-out split", "num_records": len(records),
                "n": n, "ks": ks, "temperature": temperature, "max_tokens": spec.max_tokens, "seed": cfg.seed}
    return records, n, ks, spec, settings


async def evaluate_model(model: str, opts: EvalOptions, samples_out: str | None = None) -> dict[str, Any]:
    """One policy's figures (`samples_out`: also every sample as jsonl there)."""
    from asyncrl.lab.offline.eval_policy import load_run_config, sample_and_score, summarize

    cfg, config_path = load_run_config(model, opts.config, say)
    records, n, ks, spec, settings = setup(cfg, opts)
    say(f"evaluating {cfg.model.path}: {len(records)} prompts x {n} samples at T={spec.temperature}")
    samples = await sample_and_score(cfg, records, n, spec, say)
    if samples_out:
        with open(samples_out, "w", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps({"record": s.record_index, "data_source": s.data_source, "prompt": s.prompt,
                                    "response": s.response, "reward": s.reward, "outcome": s.outcome,
                                    "finish_reason": s.finish_reason}) + "\n")
    examples = [f"{str(s.prompt)[-200:]} -> {s.response}  (reward {s.reward:g}, {s.outcome})"
                for s in samples[::n][:NUM_EXAMPLES]]
    return {"model": model, "config": str(config_path) if config_path else None, "data": settings["data"],
            "n": n, "temperature": spec.temperature, "max_tokens": spec.max_tokens, "num_records": len(records),
            **summarize(samples, n, ks), "examples": examples}


def locate_start(cfg: Config, policies: list[SavedPolicy]) -> list[SavedPolicy]:
    """The policies with the start's model.path (builtin:tiny, a hub id, a directory) made its
    directory, as the run's own start resolved it; the start left out, and said, when it is not here."""
    from asyncrl.orchestrator.components import resolve_model_path
    from asyncrl.preflight import model_directory

    out = []
    for p in policies:
        if p.name == START:
            start_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(p.path)})})
            try:
                p = replace(p, path=model_directory(resolve_model_path(start_cfg, log=say)))
            except ConfigError as e:
                say(f"the run's start is not evaluated: {e}")
                continue
        out.append(p)
    return out


async def evaluate_runs(runs: list[str | Path], opts: EvalOptions, engine=None) -> list[Path]:
    """The start and every saved policy of each run into its eval.json, one engine for all
    (`engine`: a PolicyEngine to use and leave running); the paths written. A run with no saved
    policy is named and skipped."""
    from asyncrl.lab.offline.eval_policy import load_run_config, reward_pool, sample_and_score, summarize
    from asyncrl.lab.offline.policy_engine import PolicyEngine
    from asyncrl.lab.offline.run_policies import (
        EVAL_FILE, eval_document, eval_entry, figures_table, read_eval, reusable, run_policies)

    own, written = engine is None, []
    try:
        for run in map(Path, runs):
            policies = run_policies(run, opts.final_only)
            if not policies:
                say(f"{run}: no saved policy (final/ or checkpoints/step_N/learner/policy), skipped")
                continue
            cfg, _ = load_run_config(str(policies[-1].path), opts.config, say)
            records, n, ks, spec, settings = setup(cfg, opts)
            kept = reusable(read_eval(run), settings)
            todo = locate_start(cfg, [p for p in policies if (p.name, p.step) not in kept])
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
        raise ConfigError(f"none of {', '.join(map(str, runs))} holds a saved policy")
    return written


def model_report(r: dict[str, Any]) -> str:
    """evaluate_model's result as text: settings, examples, overall and per-source figures."""
    def figures(m: dict) -> str:
        return "  ".join(f"{key} {m[key]:.3f}" for key in m if key.startswith(("avg@", "pass@", "tool_")))

    skipped = r["num_records"] - r["num_prompts"]
    outcomes = ", ".join(f"{k} {v}" for k, v in r["outcomes"].items())
    return "\n".join([
        f"policy {r['model']} (config: {r['config'] or 'default'})",
        f"data: {r['data']}, {r['n']} samples per prompt at T={r['temperature']}, max {r['max_tokens']} tokens",
        "examples:", *(f"   {ex}" for ex in r["examples"]),
        f"{figures(r)}  over {r['num_prompts']} prompts" + (f" ({skipped} too long, left out)" if skipped else ""),
        *(f"  {source}: {figures(m)}  ({m['num_prompts']} prompts)" for source, m in r["by_source"].items()),
        f"mean response {r['mean_response_tokens']:.1f} tokens; outcomes: {outcomes}",
    ])
