"""Figures and a report from any run directories: every run (or, with --group-seeds, every name
without its -s<seed> suffix) is one line per metric, with the per-arm table and collapse steps.

    python tools/plot_runs.py runs/a runs/b --out plots/
    python tools/plot_runs.py runs/mystudy/*-s* --group-seeds --out plots/ --x rollout/samples_total

Writes <out>/figures/<metric>.png (+ a .json sidecar with the legend and the plotted data),
<out>/report.md and <out>/report.json; no verdicts (those need a study file, tools/study.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str]) -> argparse.Namespace:
    from asyncrl.config.study import DEFAULT_FIGURES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories (each holding metrics.jsonl)")
    p.add_argument("--out", default="plots", help="output directory (default: plots)")
    p.add_argument("--group-seeds", action="store_true", help="runs named <arm>-s<seed> form one arm each")
    p.add_argument("--metrics", nargs="+", default=DEFAULT_FIGURES, help="metrics to draw, one figure each")
    p.add_argument("--x", default="step", help="x axis: step or a running-total column (rollout/samples_total)")
    p.add_argument("--window", type=int, default=10, help="steps of the final / peak / collapse windows")
    p.add_argument("--collapse-fraction", type=float, default=0.5, help="collapse threshold, a fraction of initial")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from pydantic import ValidationError

    from asyncrl.analysis.analyse import analyse
    from asyncrl.analysis.arms import arms_from_dirs
    from asyncrl.config.study import AnalysisSpec

    missing = [r for r in args.runs if not (Path(r) / "metrics.jsonl").exists()]
    if missing:
        print(f"error: no metrics.jsonl in {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        analysis = AnalysisSpec(figures=args.metrics, x_axis=args.x, window=args.window,
                                collapse_fraction=args.collapse_fraction)
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    arms = arms_from_dirs(args.runs, group_seeds=args.group_seeds)
    path = analyse(arms, Path(args.out), analysis, f"Runs: {', '.join(a.name for a in arms)}")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
