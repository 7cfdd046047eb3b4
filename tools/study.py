"""Run a study: a grid of arms x seeds on a base recipe, then its figures, report and verdicts.

    python tools/study.py configs/studies/skywork_sec4.yaml --quick
    python tools/study.py configs/studies/staleness.yaml observe.output_dir=/tmp/studies
    python tools/study.py configs/studies/prorl_resets.yaml --parallel 2     # 2 runs at once, one Ray cluster
    python tools/study.py configs/studies/skywork_sec4.yaml --quick --plan   # the runs and their commands
    python tools/study.py configs/studies/skywork_sec4.yaml --quick --report # figures and report only
    python tools/study.py configs/studies/skywork_sec4.yaml --quick --arms nsgd1,nsgd4   # some arms only
    python tools/study.py configs/studies/skywork_sec4.yaml --quick --evaluate  # + each arm's final avg@n

Dotted overrides after the study file apply to every arm (not to a field an arm varies). Each run
is an ordinary run directory, <observe.output_dir>/<study>[-quick]/<arm>-s<seed>, made by
launch/run.py; the same command again skips finished runs and resumes interrupted ones
(asyncrl/study/runner.py). The study directory also gets report.md, report.json, figures/
(PNG + JSON sidecars), logs/<run>.log and study.json (every run's command). --evaluate runs
tools/evaluate.py --final-only on every finished run (one vLLM engine for all, about 30 s plus a
few seconds per run on 2 cores) so the report's arm table gets each arm's held-out avg@n; without
it the column appears for runs that already have an eval.json. Exit codes: 0 every run finished
(and evaluated), 1 a run did not (or the evaluation failed), 2 a bad study file or override,
128 + signal when stopped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config.load import ConfigError  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", help="study YAML (configs/studies/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every arm, e.g. observe.output_dir=/tmp/s")
    p.add_argument("--quick", action="store_true", help="the study's quick variant (fewer steps and seeds)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once on one Ray cluster (default 1)")
    p.add_argument("--arms", default=None, help="only these arms, comma-separated (default: all)")
    p.add_argument("--plan", action="store_true", help="print the runs, what each needs and its command; run nothing")
    p.add_argument("--report", action="store_true", help="only write figures and the report from the runs there")
    p.add_argument("--evaluate", action="store_true",
                   help="evaluate each finished run's final/ on held-out data (tools/evaluate.py) for the report")
    return p.parse_intermixed_args(argv)


def report(plan, notes: list[str]) -> Path:
    from asyncrl.analysis.analyse import analyse
    from asyncrl.analysis.arms import Arm
    from asyncrl.analysis.runs import read_run

    study = plan.study
    arms = [Arm(name, [read_run(r.run_dir) for r in plan.runs if r.arm == name and r.run_dir.exists()])
            for name in plan.settings]
    missing = [a.name for a in arms if not a.runs]
    if missing:
        notes = [*notes, f"arms with no run directory yet: {', '.join(missing)}"]
    arms = [a for a in arms if a.runs]
    title = f"Study {study.name}" + (" (quick)" if plan.quick else "")
    return analyse(arms, plan.study_dir, study.analysis, title, study.description, study.findings,
                   study.sweep_plots, study.grid_names, plan.settings, notes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from asyncrl.config.study import load_study
    from asyncrl.study.plan import plan_study
    from asyncrl.study.runner import StudyRunner, write_manifest

    try:
        study = load_study(args.study)
        only = args.arms.split(",") if args.arms else None
        plan = plan_study(study, Path(args.study), args.quick, args.overrides, only)
        whole = plan_study(study, Path(args.study), args.quick, args.overrides) if args.arms else plan
        runner = StudyRunner(plan, parallel=max(1, args.parallel), log=lambda s: print(s, flush=True))
        todo = [] if args.report else runner.actions()  # --report draws whatever is there
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"study {study.name}{' (quick)' if args.quick else ''}: {len(plan.settings)} arms x "
          f"{len(plan.runs) // max(1, len(plan.settings))} seed(s) = {len(plan.runs)} runs in {plan.study_dir}")
    if args.plan:
        for run, action in todo:
            print(f"{run.name}: {action}\n  {' '.join(run.argv(plan.base))}")
        return 0
    code, notes = 0, []
    if not args.report:
        t0 = time.monotonic()
        outcomes = runner.run()
        write_manifest(whole, outcomes)
        bad = [o for o in outcomes if o.status != "finished"]
        notes.append(f"this invocation: {sum(o.action != 'skip' for o in outcomes)} run(s) made in "
                     f"{time.monotonic() - t0:.0f} s, {sum(o.action == 'skip' for o in outcomes)} finished before")
        if bad:
            notes.append("not finished: " + ", ".join(f"{o.run} ({o.status or 'not started'})" for o in bad))
            code = 1
        if runner.stop_signal is not None:
            code = 128 + runner.stop_signal
    if args.evaluate and runner.stop_signal is None:
        from asyncrl.study.runner import evaluate_finals

        if evaluate_finals(whole, log=lambda s: print(s, flush=True)) != 0:
            notes.append("the evaluation of final policies failed: see logs/evaluate.log")
            code = code or 1
    path = report(whole, notes)  # every arm that has runs, also those of earlier invocations
    print(f"report: {path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
