"""A study from its file to its report (`asyncrl study`): plan, run (resumably), evaluate, report.

Dotted overrides apply to every arm (not to a field an arm varies). Each run is an ordinary run
directory, <observe.output_dir>/<study>[-quick]/<arm>-s<seed>, made by `asyncrl run`; the same
command again skips finished runs and resumes interrupted ones (runner.py). The study directory
also gets report.md, report.json, figures/ (PNG + JSON sidecars), logs/<run>.log and study.json
(every run's command). `evaluate` runs `asyncrl evaluate --final-only` on every finished run (one
vLLM engine for all, about 30 s plus a few seconds per run on 2 cores) so the report's arm table
gets each arm's held-out avg@n; without it the column appears for runs that already have an
eval.json. The exit code: 0 every run finished (and evaluated), 1 a run did not (or the
evaluation failed), 128 + signal when stopped; a bad study file or override raises ConfigError.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from asyncrl.lab.study.plan import StudyPlan


@dataclass(frozen=True)
class StudyRequest:
    study: str
    """The study YAML, or the name of a shipped one (`staleness`, `studies/staleness`)."""
    overrides: list[str] = field(default_factory=list)
    """Dotted overrides for every arm."""
    quick: bool = False
    """The study's quick variant (fewer steps and seeds)."""
    parallel: int = 1
    """Runs at once on one Ray cluster."""
    arms: list[str] | None = None
    """Only these arms (None: all)."""
    plan_only: bool = False
    """Print the runs, what each needs and its command; run nothing."""
    report_only: bool = False
    """Only write figures and the report from the runs there."""
    evaluate: bool = False
    """Evaluate each finished run's final/ on held-out data for the report."""
    cold: bool = False
    """Every run in a process of its own, as `asyncrl run` (default: one after another on shared
    processes, lab/study/warm_runs.py)."""


def study_file(name: str) -> Path:
    """A study file by path, else a shipped one by name (configs/studies/<name>.yaml)."""
    from asyncrl.config.load import recipe_file

    path = recipe_file(name)
    return path if path.is_file() or "/" in name else recipe_file(f"studies/{name}")


def report(plan: StudyPlan, notes: list[str]) -> Path:
    """Figures, report.md and report.json of every arm of the plan that has runs."""
    from asyncrl.lab.analysis.analyse import analyse
    from asyncrl.lab.analysis.arms import Arm
    from asyncrl.lab.analysis.runs import read_run

    study = plan.study
    arms = [Arm(name, [read_run(r.run_dir) for r in plan.runs if r.arm == name and r.run_dir.exists()])
            for name in plan.settings]
    missing = [a.name for a in arms if not a.runs]
    if missing:
        notes = [*notes, f"arms with no run directory yet: {', '.join(missing)}"]
    arms = [a for a in arms if a.runs]
    title = f"Study {study.name}" + (" (quick)" if plan.quick else "")
    return analyse(arms, plan.study_dir, study.analysis, title, study.description, study.findings,
                   study.sweep_plots, study.grid_names, plan.settings, notes, aa=study.aa_pair)


def conduct(req: StudyRequest, log: Callable[[str], None] = print) -> int:
    """Plan the study and, unless req says otherwise, run, evaluate and report it; the exit code."""
    from asyncrl.lab.study.config import load_study
    from asyncrl.lab.study.plan import plan_study
    from asyncrl.lab.study.runner import StudyRunner, evaluate_finals, write_manifest

    path = study_file(req.study)
    study = load_study(path)
    plan = plan_study(study, path, req.quick, req.overrides, req.arms)
    whole = plan_study(study, path, req.quick, req.overrides) if req.arms else plan
    runner = StudyRunner(plan, parallel=max(1, req.parallel), log=log, cold=req.cold)
    todo = [] if req.report_only else runner.actions()  # report_only draws whatever is there
    log(f"study {study.name}{' (quick)' if req.quick else ''}: {len(plan.settings)} arms x "
        f"{len(plan.runs) // max(1, len(plan.settings))} seed(s) = {len(plan.runs)} runs in {plan.study_dir}")
    if req.plan_only:
        for run, action in todo:
            log(f"{run.name}: {action}\n  {' '.join(run.argv(plan.base))}")
        return 0
    code, notes = 0, []
    if not req.report_only:
        t0 = time.monotonic()
        outcomes = runner.run()
        write_manifest(whole, outcomes)
        bad = [o for o in outcomes if o.status != "finished"]
        notes.append(f"this invocation: {sum(o.action != 'skip' for o in outcomes)} run(s) made in "
                     f"{time.monotonic() - t0:.0f} s, {sum(o.action == 'skip' for o in outcomes)} finished before")
        if bad:
            notes.append("not finished: " + ", ".join(f"{o.run} ({o.status or 'not started'})" for o in bad))
            code = 1
        if runner.signals.first is not None:
            code = 128 + runner.signals.first
    if req.evaluate and runner.signals.first is None:
        if evaluate_finals(whole, log=log) != 0:
            notes.append("the evaluation of final policies failed: see logs/evaluate.log")
            code = code or 1
    path = report(whole, notes)  # every arm that has runs, also those of earlier invocations
    log(f"report: {path}")
    return code
