"""From arms to files: figures/ (PNG + JSON sidecars), report.md and report.json in one directory.
Used by `asyncrl study` after a study's runs and by `asyncrl plot` (plot_runs) on any run directories."""

from __future__ import annotations

import json
import math
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.lab.analysis.arms import Arm, arms_from_dirs, run_curve, stat_with_spread
from asyncrl.lab.analysis.config_diff import config_diff, settings_text
from asyncrl.lab.analysis.curves import SMOOTH_HALF_WIDTH, Series
from asyncrl.lab.analysis.marks import MARKED_EVENTS
from asyncrl.lab.analysis.outliers import OUTLIER_FACTOR
from asyncrl.lab.analysis.plots import is_sparse, plot_metric, plot_sweep
from asyncrl.lab.analysis.report import ArmRow, cell, render, table
from asyncrl.lab.analysis.runs import config_value
from asyncrl.lab.analysis.verdict import Verdict, fmt, judge_paired
from asyncrl.lab.offline.run_policies import final_figure
from asyncrl.lab.study.config import AnalysisSpec, Finding, OrderedCheck, StatRef, SweepPlot


def definitions(analysis: AnalysisSpec) -> str:
    w, frac, x = analysis.window, analysis.collapse_fraction, analysis.x_axis
    return (f"Curves are the mean over seeds at each step, against {x}. Final: mean of the last {w} steps; peak: "
            f"maximum of the {w}-step trailing mean; ± is the sample sd over seeds of the same number computed per "
            f"seed. Collapse: the first {x} at which the {w}-step trailing mean of {analysis.collapse_metric} falls "
            f"below {frac:g} x the mean of its first {w} steps; `never` if it does not within the run. An eval/ "
            f"metric has one point per evaluation, at the step of the policy evaluated: its final is the last "
            f"evaluation and its peak the best.")


def figure_note(smooth: int) -> str:
    """How the figures are drawn, for the report's notes."""
    line = (f"the bold line is the centred mean over {2 * smooth + 1} points ({smooth} either side), the faint one "
            "beneath it the seed mean per point" if smooth else "each line is the seed mean per point")
    marks = ", ".join(text for text, _ in MARKED_EVENTS.values())
    return (f"Figures: {line}; eval/ curves are drawn per evaluation, unsmoothed. Vertical lines in an arm's colour "
            f"mark its events ({marks}; line styles in the figure's key). An arm whose curve leaves the median "
            f"arm's range by more than {OUTLIER_FACTOR:g}x that range is drawn in a second panel with its own y axis.")


def stats_analysis(analysis: AnalysisSpec, metric: str) -> AnalysisSpec:
    """The window of a metric's statistics: 1 for an eval/ curve, whose points are evaluations
    many steps apart (final: the last evaluation, not the mean of the last `window` of them)."""
    return analysis.model_copy(update={"window": 1}) if is_sparse(metric) else analysis


def status_text(arm: Arm) -> str:
    counts: dict[str, int] = {}
    for r in arm.runs:
        counts[r.status] = counts.get(r.status, 0) + 1
    return ", ".join(f"{n}/{len(arm.runs)} {s}" for s, n in counts.items())


def arm_rows(arms: list[Arm], analysis: AnalysisSpec, metrics: list[str], settings: dict[str, str]) -> list[ArmRow]:
    rows = []
    for arm in arms:
        collapse, _ = stat_with_spread(arm, analysis.collapse_metric, "collapse_step", analysis)
        cells = {}
        for m in metrics:
            final, sd = stat_with_spread(arm, m, "final", stats_analysis(analysis, m))
            peak, _ = stat_with_spread(arm, m, "peak", stats_analysis(analysis, m))
            cells[m] = cell(final, sd, peak)
        rows.append(ArmRow(arm.name, settings.get(arm.name, ""), status_text(arm), arm.num_steps, fmt(collapse), cells))
    return rows


def eval_column(arms: list[Arm]) -> tuple[str, dict[str, str]] | None:
    """The final policy's avg@n from each run's eval.json (`asyncrl evaluate`): the column's header
    and per arm its mean ± sample sd over the seeds that have one (None: no run has an eval.json)."""
    figures = {a.name: [final_figure(r.evaluation) for r in a.runs] for a in arms}
    keys = sorted({f[0] for found in figures.values() for f in found if f})
    if not keys:
        return None
    cells = {}
    for name, found in figures.items():
        values = [f[1] for f in found if f]
        if not values:
            cells[name] = "–"
            continue
        text = mean_sd(values)
        if len(values) < len(found):
            text += f" ({len(values)}/{len(found)} runs)"
        cells[name] = text
    return f"final policy {'/'.join(keys)} (eval.json)", cells


SATURATED = "entropy_control/saturated"


def saturation_column(arms: list[Arm]) -> tuple[str, dict[str, str]] | None:
    """Per arm that ran adaptive entropy control, the share of its steps at the cap (each run's
    mean of `entropy_control/saturated`, then mean ± sample sd over seeds); None if no arm did."""
    cells = {}
    for arm in arms:
        shares = [sum(v) / len(v) for r in arm.runs if (v := list(r.series(SATURATED).values))]
        if shares:
            cells[arm.name] = mean_sd(shares)
    return ("steps at the entropy cap", cells) if cells else None


def mean_sd(values: list[float]) -> str:
    """"mean ± sample sd" of per-seed values (the mean alone for one)."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return fmt(mean)
    return f"{fmt(mean)} ± {fmt(math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)))}"


def _label(cfg: dict, fields: list[str], names: dict[str, str]) -> str:
    def short(v):
        return str(int(v)) if isinstance(v, bool) else str(v)
    return ", ".join(f"{names.get(f, f.rsplit('.', 1)[-1])}={short(config_value(cfg, f))}" for f in fields) or "all"


def sweep(arms: list[Arm], sp: SweepPlot, analysis: AnalysisSpec, names: dict[str, str], out_dir: Path) -> tuple[str, str]:
    """The sweep figure and its table: per line and x value, the statistic of each metric."""
    points: dict[str, dict[str, list[tuple[float, float, float]]]] = {m: {} for m in sp.metrics}
    rows = []
    for arm in arms:
        cfg = arm.runs[0].config
        x = config_value(cfg, sp.x_field)
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            continue
        label = _label(cfg, sp.series_fields, names)
        row = [label, fmt(x)]
        for m in sp.metrics:
            value, sd = stat_with_spread(arm, m, sp.stat, analysis)
            row.append(fmt(value) + (f" ± {fmt(sd)}" if sd is not None else ""))
            if value is not None and math.isfinite(value):
                points[m].setdefault(label, []).append((float(x), value, sd or 0.0))
        rows.append(row)
    rows.sort(key=lambda r: (r[0], float(r[1])))
    if any(points[m] for m in sp.metrics):
        plot_sweep(sp.name, names.get(sp.x_field, sp.x_field), {m: p for m, p in points.items() if p}, out_dir / "figures", sp.stat)
    text = table(["line", names.get(sp.x_field, sp.x_field), *[f"{sp.stat} {m}" for m in sp.metrics]], rows)
    return f"{sp.stat} against {sp.x_field}", text + f"\n\n![{sp.name}](figures/{sp.name}.png)"


def seed_curves(arms: list[Arm], findings: list[Finding], x_axis: str) -> dict[str, dict[int, dict[str, Series]]]:
    """arm -> seed -> metric -> that run's curve, for the metrics the findings name."""
    metrics = {"kl/reset"}  # reset_ratio reads it
    for c in (c for f in findings for c in f.checks):
        if isinstance(c, OrderedCheck):
            metrics.add(c.metric)
        else:
            metrics |= {c.left.metric} | ({c.right.metric} if isinstance(c.right, StatRef) else set())
    return {a.name: {int(r.config.get("seed", i)): {m: run_curve(r, m, x_axis) for m in metrics}
                     for i, r in enumerate(a.runs)} for a in arms}


def write_json(path: Path, verdicts: list[Verdict], rows: list[ArmRow]) -> None:
    out = {"verdicts": [{"finding": v.finding.name, "source": v.finding.source, "outcome": v.outcome,
                         "checks": [{"holds": c.holds, "text": c.text} for c in v.checks]} for v in verdicts],
           "arms": [{"arm": r.arm, "settings": r.settings, "status": r.status, "steps": r.steps,
                     "collapse_step": r.collapse, "cells": r.cells} for r in rows]}
    path.write_text(json.dumps(out, indent=1))


def analyse(arms: list[Arm], out_dir: Path, analysis: AnalysisSpec, title: str, description: str = "",
            findings: list[Finding] = (), sweep_plots: list[SweepPlot] = (), names: dict[str, str] | None = None,
            settings: dict[str, str] | None = None, notes: list[str] = (), smooth: int = SMOOTH_HALF_WIDTH,
            aa: tuple[str, str] | None = None) -> Path:
    """Write figures/, report.md and report.json under out_dir; returns report.md's path. `smooth`:
    points either side of the centred mean drawn over each curve (0: the seed means alone); `aa`:
    (an arm, its A/A copy), the noise floor of the verdicts (paired.py)."""
    names, settings = names or {}, settings or {}
    (out_dir / "figures").mkdir(parents=True, exist_ok=True)
    figures = []
    for metric in analysis.figures:
        sc = plot_metric(arms, metric, out_dir / "figures", analysis.x_axis, smooth)
        if sc is not None:
            figures.append((metric, f"figures/{sc['png']}"))
    verdicts = [judge_paired(seed_curves(arms, findings, analysis.x_axis), f, analysis, aa) for f in findings]
    copy = aa[1] if aa else None  # the A/A copy would draw a second point at its source's x
    sweeps = [sweep([a for a in arms if a.name != copy], sp, analysis, names, out_dir) for sp in sweep_plots]
    metrics = [m for m in analysis.figures if any(len(a.band(m).steps) for a in arms)]
    rows = arm_rows(arms, analysis, metrics, settings)
    evaluated = eval_column(arms)
    notes = list(notes)
    if evaluated:
        header, cells = evaluated
        for row in rows:
            row.cells[header] = cells[row.arm]
        metrics = [*metrics, header]
        notes.append(f"{header}: held-out avg@n of each run's final/ by `asyncrl evaluate`, mean ± sd over seeds.")
    saturation = saturation_column(arms)
    if saturation:
        header, cells = saturation
        for row in rows:
            row.cells[header] = cells.get(row.arm, "–")
        metrics = [*metrics, header]
        notes.append(f"{header}: the share of a run's steps at which adaptive entropy control's c sat at its "
                     f"cap c_max, mean ± sd over seeds; near 1 the arm tested a fixed coefficient, not the "
                     f"controller.")
    seeds = max((len(a.runs) for a in arms), default=0)
    if findings and seeds < 2:
        notes.insert(0, "One seed an arm: a paired interval needs 2 seeds at least, so no verdict can be "
                        "decided and every one reads inconclusive by construction. Run with 2 or more seeds "
                        "(without --quick, or a seeds override) to decide.")
    elif findings and seeds == 2:
        notes.insert(0, "Two seeds an arm: each 95% interval is the mean difference ± 12.7 x its sd / sqrt(2) "
                        "(Student's t with 1 degree of freedom), so only a difference about 9 times larger "
                        "than its seed-to-seed spread is decided; an inconclusive verdict here says the "
                        "effect is not that large, not that it is absent. Run the full preset to decide "
                        "smaller ones.")
    if figures:
        notes.append(figure_note(smooth))
    text = render(title, description, verdicts, rows, metrics, analysis.collapse_metric, definitions(analysis),
                  figures, sweeps, notes)
    report = out_dir / "report.md"
    report.write_text(text)
    write_json(out_dir / "report.json", verdicts, rows)
    return report


def eval_metrics(arms: list[Arm]) -> list[str]:
    """The held-out accuracies the runs logged (eval/avg@n, eval/pass@k), avg@ first, k ascending."""
    found = {m for a in arms for m in a.metrics() if m.startswith(("eval/avg@", "eval/pass@"))}

    def order(m: str) -> tuple:
        kind, k = m.split("@", 1)
        return (kind != "eval/avg", int(k) if k.isdigit() else 0, m)
    return sorted(found, key=order)


EPISODE_FIGURES = ("eval/tool_success_rate", "eval/tool_call_rate", "episode/tool_calls_mean", "episode/turns_mean",
                   "episode/error_frac")
"""Drawn by default for runs with episodes (environments, agents), those the runs logged."""


def episode_metrics(arms: list[Arm]) -> list[str]:
    found = {m for a in arms for m in a.metrics()}
    return [m for m in EPISODE_FIGURES if m in found]


def plot_runs(runs: list[str | Path], out_dir: Path, analysis: AnalysisSpec, group_seeds: bool = False,
              with_eval: bool = True, smooth: int = SMOOTH_HALF_WIDTH) -> Path:
    """Figures and a report (no verdicts: those need a study file) of any run directories, each
    run one arm, or (group_seeds) each name without its -s<seed> suffix; returns report.md's path.
    with_eval: also a figure of each eval/avg@n and eval/pass@k the runs logged, and for runs with
    episodes their tool and turn metrics (EPISODE_FIGURES). The settings
    column is what differs between the arms' config.yaml files (config_diff.py)."""
    missing = [str(r) for r in runs if not (Path(r) / "metrics.jsonl").exists()]
    if missing:
        raise ConfigError(f"no metrics.jsonl in {', '.join(missing)}")
    arms = arms_from_dirs(runs, group_seeds=group_seeds)
    if with_eval:
        extra = [m for m in [*eval_metrics(arms), *episode_metrics(arms)] if m not in analysis.figures]
        analysis = analysis.model_copy(update={"figures": [*analysis.figures, *extra]})
    diff = config_diff({a.name: [r.config for r in a.runs] for a in arms})
    settings = {arm: settings_text(d) for arm, d in diff.items()}
    return analyse(arms, out_dir, analysis, f"Runs: {', '.join(a.name for a in arms)}", settings=settings,
                   smooth=smooth)
