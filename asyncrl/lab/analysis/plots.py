"""Figures: PNGs of a metric per step for every arm, and of a statistic against a config field.

The only module that imports matplotlib (Agg backend: no display needed). Beside every PNG goes a
JSON sidecar read back from the drawn figure itself: its pixel size, the legend's labels and every
line's colour and x and y data. Tests compare that with the metrics files, so a figure that shows other
numbers than the runs logged, or misses an arm, fails without anyone looking at the picture.

A metric figure draws, per arm, the seed mean per point as a faint line and over it, bold, its
centred mean over `smooth` points either side (curves.centred_mean; per-step rewards swing too
much to read a trend from), with a ± sd band around that (the sd smoothed the same way). An eval/
curve (one point per evaluation) is drawn as its points, unsmoothed. Vertical lines in the arm's
colour mark its events (marks.py); an arm that would flatten the others gets a second panel with
its own y axis (outliers.py). The sidecar gives, per line, `x` and `y` (the seed means) and
`smoothed`; per panel its arms and marks; and the smoothing and the outliers.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from asyncrl.lab.analysis.arms import Arm  # noqa: E402
from asyncrl.lab.analysis.curves import SMOOTH_HALF_WIDTH, Series, centred_mean  # noqa: E402
from asyncrl.lab.analysis.marks import MARKED_EVENTS, arm_marks  # noqa: E402
from asyncrl.lab.analysis.outliers import OUTLIER_FACTOR, outlier_arms  # noqa: E402

SIZE_IN = (8.0, 4.5)
DPI = 100
RAW_ALPHA = 0.3


def file_stem(metric: str) -> str:
    """`entropy/learner` -> `entropy_learner`."""
    return metric.replace("/", "_").replace("@", "at")


def is_sparse(metric: str) -> bool:
    """One point per evaluation, not per step: drawn as points, never smoothed."""
    return metric.startswith("eval/")


def _data(line) -> tuple[list[float], list[float]]:
    return [float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()]


def _lines_of(ax) -> list[dict]:
    """Every legend line; when a smoothed line is drawn over the raw one (label `_raw`, the arm's
    name as gid), x and y are the raw line's and `smoothed` the bold line's y."""
    raw = {line.get_gid(): line for line in ax.get_lines() if line.get_label() == "_raw"}
    out = []
    for line in ax.get_lines():
        label = line.get_label()
        if label.startswith("_"):
            continue
        x, y = _data(raw.get(label, line))
        entry = {"label": label, "color": to_hex(line.get_color()), "x": x, "y": y}
        if label in raw:
            entry["smoothed"] = _data(line)[1]
        out.append(entry)
    return out


def _save(fig, legend_axes: list, out_dir: Path, stem: str, extra: dict, panels: list) -> dict:
    png = out_dir / f"{stem}.png"
    fig.savefig(png, dpi=DPI)
    width, height = fig.canvas.get_width_height()
    legends = [ax.get_legend() for ax in legend_axes]
    sidecar = {"png": png.name, "size_px": [width, height],
               "legend": [t.get_text() for leg in legends if leg for t in leg.get_texts()], **extra,
               "panels": panels}
    (out_dir / f"{stem}.json").write_text(json.dumps(sidecar, indent=1))
    plt.close(fig)
    return sidecar


def _draw_arm(ax, name: str, curve: Series, sd: tuple[float, ...], colour: str, half_width: int,
              sparse: bool) -> None:
    xs, mean = curve.steps, curve.values
    if sparse or half_width == 0:
        ax.plot(xs, mean, label=name, color=colour, linewidth=1.4, marker="o" if sparse else None, markersize=3)
    else:
        ax.plot(xs, mean, label="_raw", gid=name, color=colour, linewidth=0.8, alpha=RAW_ALPHA)
        mean, sd = centred_mean(mean, half_width), centred_mean(sd, half_width)
        ax.plot(xs, mean, label=name, color=colour, linewidth=1.6)
    if any(sd):
        ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                        color=colour, alpha=0.15, linewidth=0)


def _draw_marks(ax, arms: list[Arm], colours: dict[str, str], x_axis: str) -> list[dict]:
    """Each arm's event marks as vertical lines; their data read back from the lines drawn."""
    drawn = []
    for arm in arms:
        for m in arm_marks(arm, x_axis):
            line = ax.axvline(m.x, color=colours[arm.name], linestyle=MARKED_EVENTS[m.event][1], linewidth=0.9,
                              alpha=0.8, label="_mark")
            drawn.append({"arm": m.arm, "event": m.event, "step": m.step, "x": float(line.get_xdata()[0]),
                          "runs": list(m.runs), "color": to_hex(line.get_color())})
    kinds = [k for k in MARKED_EVENTS if any(d["event"] == k for d in drawn)]
    if kinds:  # a key of the line styles right below the x axis, kept when the arms' legend is added after it
        key = [Line2D([], [], color="0.35", linestyle=MARKED_EVENTS[k][1], label=MARKED_EVENTS[k][0]) for k in kinds]
        ax.add_artist(ax.legend(handles=key, fontsize=7, loc="upper right", bbox_to_anchor=(1.0, -0.07),
                                ncol=len(kinds), frameon=False, handlelength=3))
    return drawn


def plot_metric(arms: list[Arm], metric: str, out_dir: Path, x_axis: str = "step",
                smooth: int = SMOOTH_HALF_WIDTH) -> dict | None:
    """One figure: each arm's seed mean of `metric` per step, smoothed, with a ± sd band and its
    event marks; outlier arms in a second panel. None (and no file) when no arm logged the metric."""
    with_data = [a for a in arms if len(a.band(metric).steps)]
    if not with_data:
        return None
    sparse = is_sparse(metric)
    half_width = 0 if sparse else smooth
    colours = {a.name: to_hex(f"C{i % 10}") for i, a in enumerate(with_data)}
    curves = {a.name: a.curve(metric, x_axis) for a in with_data}
    outliers = outlier_arms({name: (min(c.values), max(c.values)) for name, c in curves.items() if len(c)})
    main = [a for a in with_data if a.name not in outliers]
    groups = [g for g in (main, [a for a in with_data if a.name in outliers]) if g]
    fig, grid = plt.subplots(1, len(groups), figsize=(SIZE_IN[0] * (1 + 0.6 * (len(groups) - 1)), SIZE_IN[1]),
                             squeeze=False)
    axes = list(grid[0])
    seeds = sorted({len(a.runs) for a in with_data})
    how = "per evaluation" if sparse else f"centred mean of {2 * half_width + 1} points" if half_width else "per point"
    panels = []
    for ax, group in zip(axes, groups):
        for arm in group:
            _draw_arm(ax, arm.name, curves[arm.name], arm.curve(metric, x_axis, values="sd").values,
                      colours[arm.name], half_width, sparse)
        marks = _draw_marks(ax, group, colours, x_axis)
        ax.set_xlabel(x_axis, loc="left")  # the marks' key goes on its right
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2 if len(group) > 6 else 1)
        is_outlier = group[0].name in outliers
        panels.append({"metric": metric, "arms": [a.name for a in group], "outliers": is_outlier,
                       "lines": _lines_of(ax), "marks": marks})
    axes[0].set_title(f"{metric} (mean ± sd over {'/'.join(map(str, seeds))} seed(s), {how})", fontsize=10)
    if outliers:
        axes[1].set_title(f"outlier arm(s): beyond {OUTLIER_FACTOR:g}x the median arm's range, own y axis",
                          fontsize=9)
    fig.tight_layout()
    missing = [a.name for a in arms if a not in with_data]
    smoothing = {"kind": "centred mean", "half_width": half_width} if half_width else None
    return _save(fig, axes, out_dir, file_stem(metric),
                 {"metric": metric, "x_axis": x_axis, "missing": missing, "smoothing": smoothing,
                  "outliers": outliers}, panels)


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
    return _save(fig, [axes[0]], out_dir, name, {"x_axis": x_label, "stat": stat}, panels)
