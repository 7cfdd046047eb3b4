"""The saved policies of a run directory, and eval.json, the file `asyncrl evaluate` writes beside them.

    runs/<name>/config.yaml  model.path                the policy the run started from (step 0)
    runs/<name>/checkpoints/step_<N>/learner/policy/   one per complete checkpoint (newest `keep`)
    runs/<name>/final/                                 after the last step of a finished run
    runs/<name>/eval.json                              {"run", "settings", "policies": [entry, ...]}

An entry is one policy's figures: `policy` (start, checkpoints/step_N or final), `step`, `avg@n`,
`pass@k`, `by_source` (the same per data source), `num_prompts`, `mean_response_tokens`. Entries
are ordered by step, final last. The start is the baseline every later policy is read against, so
it is evaluated with them (not with --final-only, nor for a run that saved nothing). A run
checkpoints its last step too, so the checkpoint of the final step holds final/'s weights; it is
not evaluated twice (the final entry stands for both).

A later evaluation with the same settings keeps the entries it can (same policy, same step) and
evaluates only the rest, so re-running after more checkpoints, or on a whole study, costs only
the new ones; entries of checkpoints since deleted (`checkpoint.keep`) stay in the file.
Pure: the standard library and PyYAML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

EVAL_FILE = "eval.json"
FINAL = "final"
START = "start"


@dataclass(frozen=True)
class SavedPolicy:
    name: str
    """`start`, `checkpoints/step_<N>` or `final`: the entry's key in eval.json."""
    step: int | None
    """The optimizer step it was saved after (0 for start; None: final/ of a run whose last step is unknown)."""
    path: Path
    """The Hugging Face model directory; for start, model.path as config.yaml gives it (a directory,
    a hub id or builtin:tiny), which the evaluation resolves."""


def final_step(run_dir: Path) -> int | None:
    """The step of final/: the last `end` event's, else summary.json's step count."""
    events = run_dir / "events.jsonl"
    if events.is_file():
        for line in reversed(events.read_text(encoding="utf-8").splitlines()):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line still being written
                continue
            if event.get("event") == "end" and isinstance(event.get("step"), int):
                return event["step"]
    summary = run_dir / "summary.json"
    if summary.is_file():
        steps = json.loads(summary.read_text()).get("steps")
        return steps if isinstance(steps, int) else None
    return None


def is_policy(path: Path) -> bool:
    """A saved policy: a Hugging Face model, or a LoRA run's adapter (learner/lora.py)."""
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def checkpoint_policies(run_dir: Path) -> list[SavedPolicy]:
    """The policy of every complete checkpoint (a COMPLETE marker), oldest first."""
    found = []
    ckpt_dir = run_dir / "checkpoints"
    for d in ckpt_dir.glob("step_*") if ckpt_dir.is_dir() else []:
        policy = d / "learner" / "policy"
        if d.name[5:].isdecimal() and (d / "COMPLETE").is_file() and is_policy(policy):
            found.append(SavedPolicy(f"checkpoints/{d.name}", int(d.name[5:]), policy))
    return sorted(found, key=lambda p: p.step)


def start_policy(run_dir: Path) -> SavedPolicy | None:
    """The policy the run started from: config.yaml's model.path, at step 0 (None without one)."""
    config = run_dir / "config.yaml"
    tree = yaml.safe_load(config.read_text()) if config.is_file() else None
    path = ((tree or {}).get("model") or {}).get("path")
    return SavedPolicy(START, 0, Path(path)) if isinstance(path, str) and path else None


def run_policies(run_dir: str | Path, final_only: bool = False) -> list[SavedPolicy]:
    """The policies to evaluate: the start, the checkpoints oldest first, final/ last; [] when the
    run saved none."""
    run_dir = Path(run_dir)
    final = None
    if is_policy(run_dir / FINAL):
        final = SavedPolicy(FINAL, final_step(run_dir), run_dir / FINAL)
    if final_only:
        return [final] if final else []
    policies = checkpoint_policies(run_dir)
    if final is not None:
        policies = [p for p in policies if p.step != final.step] + [final]
    start = start_policy(run_dir)
    return [start, *policies] if policies and start else policies


def eval_entry(policy: SavedPolicy, figures: dict[str, Any]) -> dict[str, Any]:
    """One policy's entry: its name and step, then the figures (eval_policy.summarize's keys)."""
    keep = ("num_prompts", "mean_response_tokens", "by_source", "tool_call_rate", "tool_success_rate")
    return {"policy": policy.name, "step": policy.step,
            **{k: v for k, v in figures.items() if k.startswith(("avg@", "pass@")) or k in keep}}


def read_eval(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's eval.json, or None when it has none."""
    path = Path(run_dir) / EVAL_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def reusable(old: dict[str, Any] | None, settings: dict[str, Any]) -> dict[tuple[str, int | None], dict]:
    """Entries of an earlier eval.json made with the same settings, by (policy, step)."""
    if not old or old.get("settings") != settings:
        return {}
    return {(e["policy"], e["step"]): e for e in old.get("policies", [])}


def _order(entry: dict[str, Any]) -> tuple:
    is_final = entry["policy"] == FINAL
    return (is_final, entry["step"] if entry["step"] is not None else -1)


def eval_document(run_dir: str | Path, settings: dict[str, Any], entries: list[dict[str, Any]],
                  kept: dict[tuple[str, int | None], dict] | None = None) -> dict[str, Any]:
    """eval.json's content: the new entries and the kept ones (a new one replaces a kept one of
    the same policy), ordered by step, final last."""
    by_key = dict(kept or {})
    by_key.update({(e["policy"], e["step"]): e for e in entries})
    # final/ is overwritten when a run is resumed and extended: only its newest step stands.
    finals = [k for k in by_key if k[0] == FINAL]
    newest_final = max(finals, key=lambda k: -1 if k[1] is None else k[1], default=None)
    policies = [e for k, e in by_key.items() if k[0] != FINAL or k == newest_final]
    return {"run": str(run_dir), "settings": settings, "policies": sorted(policies, key=_order)}


def final_figure(doc: dict[str, Any] | None, key: str | None = None) -> tuple[str, float] | None:
    """(`avg@n`, its value) of the final policy's entry (`key`: another figure, e.g. pass@8);
    None without an eval.json or a final entry."""
    for entry in (doc or {}).get("policies", []):
        if entry["policy"] == FINAL:
            key = key or next((k for k in entry if k.startswith("avg@")), None)
            return (key, entry[key]) if key in entry else None
    return None


def figures_table(entries: list[dict[str, Any]]) -> str:
    """A plain-text table: one line per policy, its step and its avg@ / pass@ figures."""
    keys = [k for k in (entries[0] if entries else {}) if k.startswith(("avg@", "pass@"))]
    lines = [f"{'policy':<24} {'step':>6} " + " ".join(f"{k:>8}" for k in keys)]
    for e in entries:
        step = "?" if e["step"] is None else str(e["step"])
        lines.append(f"{e['policy']:<24} {step:>6} " + " ".join(f"{e.get(k, float('nan')):>8.3f}" for k in keys))
    return "\n".join(lines)
