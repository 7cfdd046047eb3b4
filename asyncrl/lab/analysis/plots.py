"""Figures: PNGs of a metric per step for every arm, and of a statistic against a config field.

The only module that imports matplotlib (Agg backend: no display needed). Beside every PNG goes a
JSON sidecar read back from the drawn figure itself: its pixel size, the legend's labels and every
line's colour and x and y data. Tests compare that with the metrics files, so a figure that shows other
numbers than the runs logged, or misses an arm, fails without anyone looking at the picture.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from asyncrl.lab.analysis.arms import Arm  # noqa: E402

SIZE_IN = (8.0, 4.5)
DPI = 100


def file_stem(metric: str) -> str:
    """`entropy/learner` -> `entropy_learner`."""
    return metric.replace("/", "_").replace("@", "at")


def _lines_of(ax) -> list[dict]:
    return [{"label": line.get_label(), "color": to_hex(line.get_color()),
             "x": [float(v) for v in line.get_xdata()], "y": [float(v) for v in line.get_ydata()]}
            for line in ax.get_lines() if not line.get_label().startswith("_")]


def _save(fig, ax_with_legend, out_dir: Path, stem: str, extra: dict, panels: list) -> dict:
    png = out_dir / f"{stem}.png"
    fig.savefig(png, dpi=DPI)
    width, height = fig.canvas.get_width_height()
    legend = ax_with_legend.get_legend()
    sidecar = {"png": png.name, "size_px": [width, height],
               "legend": [t.get_text() for t in legend.get_texts()] if legend else [], **extra,
               "panels": panels}
    (out_dir / f"{stem}.json").write_text(json.dumps(sidecar, indent=1))
    plt.close(fig)
    return sidecar


def plot_metric(arms: list[Arm], metric: str, out_dir: Path, x_axis: str = "step") -> dict | None:
    """One figure: each arm's seed mean of `metric` per step, with a ± sd band. None (and no
    file) when no arm logged the metric."""
    with_data = [a for a in arms if len(a.band(metric).steps)]
    if not with_data:
        return None
    fig, ax = plt.subplots(figsize=SIZE_IN)
    for arm in with_data:
        curve = arm.curve(metric, x_axis)
        xs, mean, sd = curve.steps, curve.values, arm.curve(metric, x_axis, values="sd").values
        (line,) = ax.plot(xs, mean, label=arm.name, linewidth=1.4)
        if any(sd):
            ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                            color=line.get_color(), alpha=0.18, linewidth=0)
    ax.set_xlabel(x_axis)
    ax.set_ylabel(metric)
    seeds = sorted({len(a.runs) for a in with_data})
    ax.set_title(f"{metric} (mean ± sd over {'/'.join(map(str, seeds))} seed(s))")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if len(with_data) > 6 else 1)
    fig.tight_layout()
    missing = [a.name for a in arms if a not in with_data]
    return _save(fig, ax, out_dir, file_stem(metric), {"metric": metric, "x_axis": x_axis, "missing": missing},
                 [{"metric": metric, "lines": _lines_of(ax)}])


def plot_sweep(name: str, x_label: str, points: dict[str, dict[str, list[tuple[float, float, float]]]],
               out_dir: Path, stat: str) -> dict:
    """Panels, one per metric: `points[metric][series label]` is a list of (x, value, sd) drawn as
    one line with error bars, x ascending."""
    metrics = list(points)
    ncols = min(3, len(metrics))
    nrows = -(-len(metrics) // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    panels = []
    for ax, metric in zip(axes, metrics):
        for label, pts in points[metric].items():
            xs, ys, sds = zip(*sorted(pts))
            (line,) = ax.plot(xs, ys, label=label, marker="o", linewidth=1.2)
            ax.errorbar(xs, ys, yerr=sds, fmt="none", ecolor=line.get_color(), capsize=3)
        ax.set_xlabel(x_label)
        ax.set_title(f"{stat} {metric}", fontsize=10)
        ax.grid(alpha=0.3)
        panels.append({"metric": metric, "lines": _lines_of(ax)})
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, axes[0], out_dir, name, {"x_axis": x_label, "stat": stat}, panels)
