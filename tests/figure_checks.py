"""Checking a figure as a picture against the runs it was drawn from (used by the unit and e2e
tests of plots): the PNG decodes at the size the figure had, holds each line's colour, the legend
names exactly the expected arms, and each line's points are the seed means recomputed here, by
hand, from the metrics.jsonl files (the raw line's: a smoothed one drawn over it is in `smoothed`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image


def seed_means(run_dirs: list[Path], metric: str) -> tuple[list[float], list[float]]:
    by_step: dict[float, list[float]] = {}
    for d in run_dirs:
        for line in (Path(d) / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row.get(metric) is not None:
                by_step.setdefault(float(row["step"]), []).append(float(row[metric]))
    steps = sorted(by_step)
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def check_png(png: Path, sidecar: dict) -> np.ndarray:
    img = Image.open(png)
    img.load()
    assert img.format == "PNG" and list(img.size) == sidecar["size_px"]
    pixels = np.asarray(img.convert("RGB")).reshape(-1, 3).astype(int)
    assert len(np.unique(pixels, axis=0)) > 50  # not a blank canvas
    return pixels


def has_colour(pixels: np.ndarray, hex_colour: str, tolerance: int = 8) -> bool:
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return bool((np.abs(pixels - rgb).max(axis=1) <= tolerance).any())


def check_metric_figure(fig_dir: Path, metric: str, arms: dict[str, list[Path]]) -> dict:
    """`arms`: legend label -> the run directories whose seed mean the line must be."""
    sidecar = json.loads((fig_dir / (metric.replace("/", "_") + ".json")).read_text())
    pixels = check_png(fig_dir / sidecar["png"], sidecar)
    assert sidecar["metric"] == metric
    # an outlier arm has a panel (and a legend) of its own: every arm once, over all panels
    assert sorted(sidecar["legend"]) == sorted(arms) and len(sidecar["legend"]) == len(arms)
    lines = {line["label"]: line for panel in sidecar["panels"] for line in panel["lines"]}
    assert sorted(lines) == sorted(arms)
    for label, dirs in arms.items():
        steps, means = seed_means(dirs, metric)
        assert steps, f"no {metric} in {dirs}"
        assert lines[label]["x"] == steps
        assert np.allclose(lines[label]["y"], means, rtol=0, atol=1e-12)
        assert has_colour(pixels, lines[label]["color"]), f"{label}'s line colour is not in the picture"
    return sidecar
