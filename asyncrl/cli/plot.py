"""`asyncrl plot`: figures and a report from any run directories: every run (or, with
--group-seeds, every name without its -s<seed> suffix) is one line per metric, with the per-arm
table and collapse steps (asyncrl/lab/analysis/analyse.py).

    asyncrl plot runs/a runs/b --out plots/
    asyncrl plot runs/mystudy/*-s* --group-seeds --out plots/ --x rollout/samples_total

Writes <out>/figures/<metric>.png (+ a .json sidecar with the legend and the plotted data),
<out>/report.md and <out>/report.json; no verdicts (those need a study file, `asyncrl study`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SUMMARY = "figures and a report (no verdicts) of any run directories"


def parse_args(argv: list[str]) -> argparse.Namespace:
    from asyncrl.lab.study.config import DEFAULT_FIGURES

    p = argparse.ArgumentParser(prog="asyncrl plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (each holding metrics.jsonl)")
    p.add_argument("--out", default="plots", help="output directory (default: plots)")
    p.add_argument("--group-seeds", action="store_true", help="runs named <arm>-s<seed> form one arm each")
    p.add_argument("--metrics", nargs="+", default=DEFAULT_FIGURES, help="metrics to draw, one figure each")
    p.add_argument("--x", default="step", help="x axis: step or a running-total column (rollout/samples_total)")
    p.add_argument("--window", type=int, default=10, help="steps of the final / peak / collapse windows")
    p.add_argument("--collapse-fraction", type=float, default=0.5, help="collapse threshold, a fraction of initial")
    return p.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from pydantic import ValidationError

    from asyncrl.config import ConfigError
    from asyncrl.lab.analysis.analyse import plot_runs
    from asyncrl.lab.study.config import AnalysisSpec

    try:
        analysis = AnalysisSpec(figures=args.metrics, x_axis=args.x, window=args.window,
                                collapse_fraction=args.collapse_fraction)
        path = plot_runs(args.runs, Path(args.out), analysis, args.group_seeds)
    except (ConfigError, ValidationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0
