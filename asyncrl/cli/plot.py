"""`asyncrl plot`: figures and a report from any run directories: every run (or, with
--group-seeds, every name without its -s<seed> suffix) is one line per metric, with the per-arm
table and collapse steps (asyncrl/lab/analysis/analyse.py).

    asyncrl plot runs/a runs/b --out plots/
    asyncrl plot runs/mystudy/*-s* --group-seeds --out plots/ --x rollout/samples_total
    asyncrl plot runs/a runs/b --metrics reward/mean eval/avg@8 --smooth 0

Every curve is the seed mean, faint, under its centred mean over 2 x --smooth + 1 points, bold.
The held-out eval/avg@n and eval/pass@k the runs logged get figures too (one point per evaluation,
at the evaluated policy's step). Vertical lines mark resumes, reference resets, rescaling, stage
changes and lost actors (events.jsonl); an arm that would flatten the others gets a panel of its
own. The report's settings column lists the config.yaml fields that differ between the arms.

Writes <out>/figures/<metric>.png (+ a .json sidecar with the legend, the plotted data, the marks
and the panels), <out>/report.md and <out>/report.json; no verdicts (those need a study file,
`asyncrl study`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SUMMARY = "figures and a report (no verdicts) of any run directories"


def parse_args(argv: list[str]) -> argparse.Namespace:
    from asyncrl.lab.analysis.curves import SMOOTH_HALF_WIDTH
    from asyncrl.lab.study.config import DEFAULT_FIGURES

    p = argparse.ArgumentParser(prog="asyncrl plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (each holding metrics.jsonl)")
    p.add_argument("--out", default="plots", help="output directory (default: plots)")
    p.add_argument("--group-seeds", action="store_true", help="runs named <arm>-s<seed> form one arm each")
    p.add_argument("--metrics", nargs="+", default=None,
                   help=f"metrics to draw, one figure each (default: {' '.join(DEFAULT_FIGURES)}, every "
                        "eval/avg@n and eval/pass@k the runs logged, and for runs with episodes their tool "
                        "success, tool calls, turns and error fraction)")
    p.add_argument("--smooth", type=int, default=SMOOTH_HALF_WIDTH,
                   help=f"points either side of the centred mean drawn over each curve (default {SMOOTH_HALF_WIDTH}; "
                        "0: none)")
    p.add_argument("--x", default="step", help="x axis: step, elapsed (seconds since each run's start; `time` "
                                                "means the same) or a running-total column (rollout/samples_total)")
    p.add_argument("--window", type=int, default=10, help="steps of the final / peak / collapse windows")
    p.add_argument("--collapse-fraction", type=float, default=0.5, help="collapse threshold, a fraction of initial")
    return p.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from pydantic import ValidationError

    from asyncrl.config import ConfigError
    from asyncrl.lab.analysis.analyse import plot_runs
    from asyncrl.lab.study.config import DEFAULT_FIGURES, AnalysisSpec

    if args.x == "time":  # a row's time is Unix time: runs started apart would land far apart
        args.x = "elapsed"
    if args.smooth < 0:
        print("error: --smooth must be 0 or more", file=sys.stderr)
        return 2
    try:
        analysis = AnalysisSpec(figures=args.metrics or DEFAULT_FIGURES, x_axis=args.x, window=args.window,
                                collapse_fraction=args.collapse_fraction)
        path = plot_runs(args.runs, Path(args.out), analysis, args.group_seeds, with_eval=args.metrics is None,
                         smooth=args.smooth)
    except (ConfigError, ValidationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0
