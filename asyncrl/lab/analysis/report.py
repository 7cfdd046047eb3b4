"""report.md: the text of a study's (or a list of runs') report, built from numbers computed
elsewhere. Pure string building: verdicts, the per-arm table, sweep tables, figures, failures."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.lab.analysis.verdict import Verdict, fmt


@dataclass(frozen=True)
class ArmRow:
    """One line of the per-arm table."""

    arm: str
    settings: str  # the arm's own overrides, as text
    status: str  # e.g. "3/3 finished"
    steps: int
    collapse: str  # the collapse step, or "never"
    cells: dict[str, str]  # metric -> "final ± sd / peak"


def cell(final: float | None, sd: float | None, peak: float | None) -> str:
    if final is None:
        return "–"
    spread = f" ± {fmt(sd)}" if sd is not None else ""
    return f"{fmt(final)}{spread} / {fmt(peak)}"


def table(header: list[str], rows: list[list[str]]) -> str:
    esc = [[c.replace("|", "\\|") for c in r] for r in [header, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


def verdict_table(verdicts: list[Verdict]) -> str:
    rows = [[v.finding.name + (f" ({v.finding.source})" if v.finding.source else ""), f"**{v.outcome}**", v.numbers]
            for v in verdicts]
    return table(["finding", "verdict", "paired seed difference: mean [95% interval] (seeds)"], rows)


def arm_table(rows: list[ArmRow], metrics: list[str], collapse_metric: str) -> str:
    header = ["arm", "settings", "runs", "steps", f"collapse ({collapse_metric})", *metrics]
    body = [[r.arm, r.settings or "–", r.status, str(r.steps), r.collapse, *(r.cells.get(m, "–") for m in metrics)]
            for r in rows]
    return table(header, body)


def render(title: str, description: str, verdicts: list[Verdict], arm_rows: list[ArmRow], metrics: list[str],
           collapse_metric: str, definitions: str, figures: list[tuple[str, str]],
           sweeps: list[tuple[str, str]], notes: list[str]) -> str:
    """The whole report. figures: (caption, relative png path); sweeps: (title, markdown table)."""
    parts = [f"# {title}", ""]
    if description:
        parts += [description.strip(), ""]
    if verdicts:
        parts += ["## Verdicts", "", verdict_table(verdicts), ""]
    for heading, text in sweeps:
        parts += [f"## {heading}", "", text, ""]
    parts += ["## Arms", "", "Each cell: final ± sd over seeds / peak.", "",
              arm_table(arm_rows, metrics, collapse_metric), "", definitions, ""]
    if notes:
        parts += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    if figures:
        parts += ["## Figures", ""]
        for caption, path in figures:
            parts += [f"![{caption}]({path})", ""]
    return "\n".join(parts)
