"""A study's plan: which runs it makes, with which config fields, in which directory. Pure: no
process is started here (asyncrl/lab/study/runner.py does that).

Each run is `python -m asyncrl run --config <base> field=value ...` with the fields merged in this order,
a later one replacing an earlier one: the study's `overrides`; under --quick `quick.overrides`;
the arm's own overrides (its grid values included); total_steps (the study's or quick's, or the
command line's, times the arm's steps_factor); the command line's overrides; and last seed, name
(`<arm>-s<seed>`) and observe.output_dir (the study directory). A command-line override may not
set a field an arm sets (that would erase what the arms compare), nor seed or name.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asyncrl.config.load import ConfigError, find_recipe, format_override, load_config, parse_override
from asyncrl.lab.study.config import StudyConfig

RESERVED = ("seed", "name")

Action = Literal["skip", "start", "resume", "restart"]
"""What a run needs (runner.py decide): nothing, a fresh start, a resume, or a fresh start over a
directory moved aside."""


@dataclass
class Outcome:
    """What one invocation did with a run: its action, exit code, seconds and final status."""

    run: str
    action: Action
    exit_code: int | None = None
    seconds: float = 0.0
    status: str = ""


@dataclass(frozen=True)
class ArmRun:
    arm: str
    seed: int
    run_dir: Path
    fields: dict[str, Any]  # every field this study sets for the run (its config.yaml must agree)

    @property
    def name(self) -> str:
        return self.run_dir.name

    def argv(self, base: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "asyncrl", "run", "--config", str(base),
                *(format_override(k, v) for k, v in self.fields.items()), *extra]


def move_aside(run: ArmRun, study_dir: Path) -> None:
    """A run restarted from scratch: its old directory goes to <study dir>/_restarted/<run>.<k>."""
    attic = study_dir / "_restarted"
    attic.mkdir(exist_ok=True)
    k = sum(1 for p in attic.glob(f"{run.name}.*")) + 1
    shutil.move(str(run.run_dir), str(attic / f"{run.name}.{k}"))


@dataclass(frozen=True)
class StudyPlan:
    study: StudyConfig
    quick: bool
    base: Path
    study_dir: Path
    runs: list[ArmRun]
    settings: dict[str, str]  # arm -> its own overrides as text (the report's `settings` column)


def _cli_fields(cli_overrides: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for text in cli_overrides:
        key, value = parse_override(text)
        if key in out:
            raise ConfigError(f"override {key!r} is given twice")
        if key in RESERVED:
            raise ConfigError(f"override {key!r}: a study sets {' and '.join(RESERVED)} for every run itself")
        out[key] = value
    return out


def settings_text(overrides: dict[str, Any], steps_factor: float) -> str:
    parts = [format_override(k, v) for k, v in overrides.items()]
    if steps_factor != 1:
        parts.append(f"steps x{steps_factor:g}")
    return ", ".join(parts)


def plan_study(study: StudyConfig, study_path: Path, quick: bool, cli_overrides: list[str],
               only: list[str] | None = None) -> StudyPlan:
    """Every run of the study (of the arms named in `only`, when given), each config validated (a
    bad field raises ConfigError naming the arm)."""
    base = find_recipe(study.base, study_path)
    cli = _cli_fields(cli_overrides)
    common = {**study.overrides, **(study.quick.overrides if quick else {})}
    output_dir = cli.pop("observe.output_dir", common.pop("observe.output_dir", None))
    if output_dir is None:
        output_dir = load_config(base).observe.output_dir
    study_dir = (Path(output_dir) / (study.name + ("-quick" if quick else ""))).resolve()
    steps = cli.pop("total_steps", None) or (study.quick.total_steps if quick else None) or study.total_steps
    seeds = (study.quick.seeds if quick else None) or study.seeds
    arms = study.arm_specs(quick)
    unknown = sorted(set(only or []) - {a.name for a in arms})
    if unknown:
        raise ConfigError(f"no arm named {unknown[0]!r} (arms: {', '.join(a.name for a in arms)})")
    runs, settings = [], {}
    for arm in (a for a in arms if only is None or a.name in only):
        clash = sorted(set(cli) & set(arm.overrides))
        if clash:
            raise ConfigError(f"override {clash[0]!r} is what arm {arm.name!r} varies; it cannot be set for every arm")
        settings[arm.name] = settings_text(arm.overrides, arm.steps_factor)
        for seed in seeds:
            fields = {**common, **arm.overrides, "total_steps": max(1, round(steps * arm.steps_factor)), **cli,
                      "seed": seed, "name": f"{arm.name}-s{seed}", "observe.output_dir": str(study_dir)}
            try:
                load_config(base, [format_override(k, v) for k, v in fields.items()])
            except ConfigError as e:
                raise ConfigError(f"arm {arm.name!r}: {e}") from None
            runs.append(ArmRun(arm.name, seed, study_dir / f"{arm.name}-s{seed}", fields))
    return StudyPlan(study, quick, base, study_dir, runs, settings)


@dataclass
class StopSignals:
    """The SIGINT / SIGTERM / SIGHUP a study received: the first says how it stops (its runs stop
    after their step and the exit code is 128 + it); a second stops at once."""

    count: int = 0
    first: int | None = None

    def received(self, signum: int) -> bool:
        """Count `signum`; True when it is the first."""
        self.count += 1
        if self.first is None:
            self.first = signum
        return self.count == 1
