"""The study file: a grid of arms (each a name and dotted overrides on a base recipe) x seeds, what
`--quick` shrinks, how the figures and the report are made, and the rules that turn the numbers
into one verdict per finding. `asyncrl study` runs a study (asyncrl/lab/study/); asyncrl/lab/analysis/
reads the runs and applies the rules.

    name: skywork_sec4
    base: tiny_cpu                     # a recipe, as `base:` in a recipe
    overrides: {algo.eps_high: 0.2}    # every arm
    total_steps: 300
    seeds: [0, 1, 2]
    arms:
      - {name: nsgd1, overrides: {buffer.minibatch_prompts: 8}}
      - {name: nsgd4, overrides: {buffer.minibatch_prompts: 2}, steps_factor: 4}
    grid: {buffer.max_staleness: [0, 4]}   # or/and: the product of these values, one arm each
    quick: {total_steps: 60, seeds: [0], overrides: {eval.every_steps: 0}}
    findings:
      - name: off-policy updates collapse entropy faster
        source: Skywork-OR1 4.4
        checks:
          - {kind: ordered, arms: [nsgd1, nsgd4], stat: final, direction: decreasing}

Every statistic a check reads is taken from the arm's seed-mean curve (asyncrl/lab/analysis/curves.py
defines each). A finding is reproduced when all its checks hold, not reproduced when one fails,
inconclusive when a number is missing (an arm that did not run, a metric the runs do not log); a
finding without a source is a hypothesis and reads holds / does not hold.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from asyncrl.config.load import ConfigError, explain, read_yaml
from asyncrl.config.section import _Section

Stat = Literal["initial", "final", "last", "peak", "min", "mean", "collapse_step", "slope", "mean_abs_dev",
               "reset_ratio"]
DEFAULT_FIGURES = ["entropy/learner", "entropy/behaviour_sampled", "reward/mean", "clip/low_frac",
                   "clip/high_frac", "staleness/mean", "entropy/coef", "kl/mean"]
ARM_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$"


class StatRef(_Section):
    """One number: a statistic of one metric of one arm."""

    arm: str
    """Arm name (a grid arm's generated name, see StudyConfig.grid_names)."""
    metric: str = "entropy/learner"
    """Metric key in metrics.jsonl."""
    stat: Stat = "final"
    """initial / final: mean of the first / last analysis.window steps; last: the last logged value
    (for sparse metrics such as eval/avg@8, logged at step 0 and the end); peak / min: of the curve
    smoothed over analysis.window steps; mean: of all steps; collapse_step: see analysis; slope:
    least-squares slope per step over the last analysis.tail_frac of steps; mean_abs_dev: mean
    |value - target| over that tail; reset_ratio: mean over reference resets of (mean of the
    analysis.window steps after the reset) / (mean of the window up to and including it)."""
    target: float | None = None
    """The target of mean_abs_dev (required there, unused by the others)."""

    @model_validator(mode="after")
    def _target(self) -> StatRef:
        if (self.stat == "mean_abs_dev") != (self.target is not None):
            raise ValueError("target is required by stat mean_abs_dev and only by it")
        return self


class CompareCheck(_Section):
    kind: Literal["compare"]
    """Holds when `left op factor * right`."""
    left: StatRef
    """The number compared."""
    op: Literal["gt", "lt"]
    """gt: left > factor * right; lt: left < factor * right."""
    right: StatRef | float
    """Another arm's (or metric's) number, or a constant."""
    factor: float = 1.0
    """Scales right, e.g. 1.5 for `at least 50% above`."""


class OrderedCheck(_Section):
    kind: Literal["ordered"]
    """Holds when the arms' numbers are strictly monotone in the order given."""
    arms: list[str] = Field(min_length=2)
    """The arms, in the order of the knob being varied."""
    metric: str = "entropy/learner"
    """Metric key in metrics.jsonl."""
    stat: Stat = "final"
    """As in StatRef."""
    target: float | None = None
    """As in StatRef (mean_abs_dev only)."""
    direction: Literal["increasing", "decreasing"]
    """Along `arms`."""

    def refs(self) -> list[StatRef]:
        return [StatRef(arm=a, metric=self.metric, stat=self.stat, target=self.target) for a in self.arms]


Check = Annotated[CompareCheck | OrderedCheck, Field(discriminator="kind")]


class Finding(_Section):
    name: str
    """One line: the finding as the paper states it (or the hypothesis tested)."""
    source: str = ""
    """Where it comes from, e.g. `Skywork-OR1 4.4, Figure 16` (empty: a new hypothesis)."""
    checks: list[Check] = Field(min_length=1)
    """All must hold for the verdict `reproduced` (`holds` for a hypothesis)."""


class ArmSpec(_Section):
    name: str = Field(pattern=ARM_NAME)
    """Names the arm's run directories (<name>-s<seed>) and its legend entry."""
    overrides: dict[str, Any] = {}
    """Dotted config fields -> values, on top of the study's overrides."""
    steps_factor: float = Field(1.0, gt=0)
    """total_steps of this arm = the study's (or quick's) total_steps x this, rounded (e.g. N_SGD,
    so that arms with more optimizer steps per rollout batch see as many rollout batches)."""


AA_SAMPLING_SEED_OFFSET = 1_000_003
"""The A/A copy's rollout.sampling_seed_offset: far from any seed list a study uses."""


class QuickSpec(_Section):
    total_steps: int | None = Field(None, gt=0)
    """total_steps under --quick (None: the study's)."""
    seeds: list[int] | None = Field(None, min_length=1)
    """Seeds under --quick (None: the study's)."""
    overrides: dict[str, Any] = {}
    """Added to the study's overrides under --quick (under the arms' own), e.g. eval.every_steps: 0."""
    grid: dict[str, list[Any]] = {}
    """Replaces the values of some grid fields under --quick."""
    arms: list[str] | None = None
    """Only these arms (by name) under --quick (None: all)."""


class SweepPlot(_Section):
    """A figure of a statistic against a numeric config field, one line per combination of
    `series_fields` (the staleness study: final entropy against buffer.max_staleness)."""

    name: str = Field(pattern=ARM_NAME)
    """File name of the figure (figures/<name>.png)."""
    x_field: str
    """Dotted config field on the x axis, read from each run's config.yaml."""
    series_fields: list[str] = []
    """Dotted config fields whose values split the arms into lines."""
    metrics: list[str] = Field(["entropy/learner", "reward/mean", "clip/high_frac"], min_length=1)
    """One panel each."""
    stat: Stat = "final"
    """The statistic plotted (as in StatRef; not mean_abs_dev)."""

    @model_validator(mode="after")
    def _no_target(self) -> SweepPlot:
        if self.stat == "mean_abs_dev":
            raise ValueError("stat mean_abs_dev needs a target, which a sweep plot has not")
        return self


class AnalysisSpec(_Section):
    figures: list[str] = list(DEFAULT_FIGURES)
    """Metrics drawn per step, one figure each, every arm a line (mean) and a band (± sd over seeds)."""
    x_axis: str = "step"
    """`step` (optimizer steps) or a running-total column such as rollout/samples_total (samples
    generated: equal data budgets line up), averaged over seeds at each step."""
    window: int = Field(10, ge=1)
    """Steps averaged for initial / final, and the trailing smoothing window of peak / min / collapse."""
    tail_frac: float = Field(0.5, gt=0, le=1)
    """The last fraction of steps that slope and mean_abs_dev look at."""
    collapse_metric: str = "entropy/learner"
    """The entropy whose collapse step the report gives per arm."""
    collapse_fraction: float = Field(0.5, gt=0, lt=1)
    """Collapse: the first step at which the trailing `window`-step mean falls below this fraction
    of the mean of the first `window` steps."""


class StudyConfig(_Section):
    name: str = Field(pattern=ARM_NAME)
    """The study directory is <observe.output_dir>/<name> (<name>-quick under --quick)."""
    description: str = ""
    """What the study asks; printed at the top of report.md."""
    base: str = "tiny_cpu"
    """The recipe every arm starts from: a path (relative to the study file, the working directory or
    the project) or a name in configs/."""
    overrides: dict[str, Any] = {}
    """Dotted config fields -> values for every arm."""
    total_steps: int = Field(gt=0)
    """Optimizer steps of an arm (times its steps_factor)."""
    seeds: list[int] = Field([0], min_length=1)
    """Each arm runs once per seed (the config's `seed`)."""
    arms: list[ArmSpec] = []
    """Arms given one by one."""
    grid: dict[str, list[Any]] = {}
    """Dotted fields -> values: one more arm per combination, named from grid_names and the values."""
    grid_names: dict[str, str] = {}
    """Short name per grid field for the generated arm names (default: the field's last part), e.g.
    {buffer.max_staleness: eta} gives eta0, eta1, ...; booleans read 0 / 1."""
    quick: QuickSpec = QuickSpec()
    """What --quick changes (fewer steps and seeds, evaluation off)."""
    analysis: AnalysisSpec = AnalysisSpec()
    """Figures, smoothing and the collapse definition."""
    sweep_plots: list[SweepPlot] = []
    """Figures of a statistic against a config field."""
    findings: list[Finding] = []
    """What the study tests, each with its verdict rule (on paired seed differences with 95%
    intervals, asyncrl/lab/analysis/paired.py)."""
    aa_arm: str | None = None
    """An arm run twice: as itself and as `<name>-aa`, the same config, seeds and prompts but
    another sampling seed (rollout.sampling_seed_offset): their paired differences are what a
    rerun varies, the noise floor a difference between two arms must exceed to count (None: no
    floor, only the interval). A copy with the same sampling seed would be identical to its source
    (runs of a seed are deterministic) and measure nothing."""

    @property
    def aa_pair(self) -> tuple[str, str] | None:
        return (self.aa_arm, f"{self.aa_arm}-aa") if self.aa_arm else None

    @model_validator(mode="after")
    def _consistent(self) -> StudyConfig:
        for f in self.grid_names:
            if f not in self.grid:
                raise ValueError(f"grid_names: {f!r} is not a grid field")
        for f, values in (*self.grid.items(), *self.quick.grid.items()):
            if not values:
                raise ValueError(f"grid: {f!r} has no values")
        for f in self.quick.grid:
            if f not in self.grid:
                raise ValueError(f"quick.grid: {f!r} is not a grid field")
        names = [a.name for a in self.arm_specs(quick=False)]
        if not names:
            raise ValueError("a study needs arms or a grid")
        if self.aa_arm is not None and self.aa_arm not in names:
            raise ValueError(f"aa_arm: no arm named {self.aa_arm!r} (arms: {', '.join(names)})")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"arm names given twice: {', '.join(dup)}")
        quick_names = [a.name for a in self._all_arms(quick=True)]
        for n in self.quick.arms or []:
            if n not in quick_names:
                raise ValueError(f"quick.arms: no arm named {n!r} (arms under --quick: {', '.join(quick_names)})")
        for i, finding in enumerate(self.findings):
            for j, check in enumerate(finding.checks):
                for ref in check.refs() if isinstance(check, OrderedCheck) else _refs_of(check):
                    if ref.arm not in names:
                        raise ValueError(f"findings.{i}.checks.{j}: no arm named {ref.arm!r} "
                                         f"(arms: {', '.join(names)})")
        return self

    def arm_specs(self, quick: bool) -> list[ArmSpec]:
        """The explicit arms, then one per combination of the grid (in the order written); under
        quick the grid's replaced values and quick.arms apply."""
        arms = self._all_arms(quick)
        if quick and self.quick.arms is not None:
            arms = [a for a in arms if a.name in self.quick.arms]
        index = next((i for i, a in enumerate(arms) if a.name == self.aa_arm), None)
        if index is not None:  # right after its source: runs of one setting share processes (warm.py)
            source = arms[index]
            copy = {"name": f"{self.aa_arm}-aa",
                    "overrides": {**source.overrides, "rollout.sampling_seed_offset": AA_SAMPLING_SEED_OFFSET}}
            arms.insert(index + 1, source.model_copy(update=copy))
        return arms

    def _all_arms(self, quick: bool) -> list[ArmSpec]:
        grid = {**self.grid, **(self.quick.grid if quick else {})}
        arms = list(self.arms)
        if not grid:
            return arms
        for combo in itertools.product(*grid.values()):
            fields = dict(zip(grid, combo))
            name = "-".join(f"{self.grid_names.get(f, f.rsplit('.', 1)[-1])}{_short(v)}" for f, v in fields.items())
            arms.append(ArmSpec(name=name, overrides=fields))
        return arms


def _refs_of(check: CompareCheck) -> list[StatRef]:
    return [check.left] + ([check.right] if isinstance(check.right, StatRef) else [])


def _short(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def load_study(path: str | Path) -> StudyConfig:
    """Read and validate a study file; a bad field raises ConfigError naming it. `base` is
    resolved against the study file's directory."""
    path = Path(path)
    tree = read_yaml(path)
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    try:
        return StudyConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(explain(e, StudyConfig, f"{path}: invalid study")) from None
