"""Training stages and online filtering: pure bookkeeping the orchestrator calls between steps.

- `ResolvedStage` / `resolve_stages`: the run's `stages` with every None filled from the run's
  sections (rollout.max_tokens, rollout.group_size, rollout.temperature, buffer.token_budget), so
  the orchestrator never looks in two places. No stages configured means one stage, the run itself.
- `StageTracker`: which stage the run is in. Multi-stage training as in Skywork-OR1 section 3.2.2
  (the context length grows stage by stage) and Ring-lite section 3.4 (stages with different data
  and lengths). A stage ends after its `steps`, or earlier once the mean reward of its last
  `until_window` steps reaches `until_reward_mean`.
- `PassRateTracker`: per-record pass rates during a stage, for online filtering (Skywork-OR1
  section 3.1): entering a stage with `online_filter`, the orchestrator calls
  `source.exclude(tracker.solved())` and then `tracker.reset()`.

Deviations from the papers:
- Pass rates are measured on the samples the run drew during the stage (with whatever policy
  version produced them), not in a separate evaluation pass with the final policy of the stage.
- A prompt not drawn during the previous stage has no pass rate and is kept.
- Only prompts solved by every sample (pass rate 1) are dropped; Skywork-OR1 also drops pass rate 0
  in its offline filtering, which is a separate tool here.
- `until_reward_mean` needs a full window of steps with a reward mean (steps where no group
  reported a reward are skipped), so one lucky step cannot end a stage.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from asyncrl.config import Config, DataConfig, DataMixConfig, StageConfig


@dataclass(frozen=True)
class ResolvedStage:
    index: int
    name: str
    steps: int | None
    """Optimizer steps in the stage; None runs to total_steps (only the last stage)."""
    until_reward_mean: float | None
    until_window: int
    data: list[DataMixConfig] | None
    """The stage's mixture; None: the run's data section (see `stage_mixture`)."""
    max_tokens: int
    group_size: int
    temperature: float
    token_budget: int
    online_filter: bool


def resolve_stages(cfg: Config) -> list[ResolvedStage]:
    stages = cfg.stages or [StageConfig()]

    def pick(value, default):
        return default if value is None else value

    return [ResolvedStage(
        index=i, name=pick(st.name, f"stage{i}"), steps=st.steps, until_reward_mean=st.until_reward_mean,
        until_window=st.until_window, data=st.data,
        max_tokens=pick(st.max_tokens, cfg.rollout.max_tokens),
        group_size=pick(st.group_size, cfg.rollout.group_size),
        temperature=pick(st.temperature, cfg.rollout.temperature),
        token_budget=pick(st.token_budget, cfg.buffer.token_budget),
        online_filter=st.online_filter,
    ) for i, st in enumerate(stages)]


def stage_mixture(stage: ResolvedStage, run_data: DataConfig) -> list[DataMixConfig]:
    """The stage's mixture, or the run's data section as a mixture of one (same record keys)."""
    if stage.data is not None:
        return list(stage.data)
    return [DataMixConfig(**run_data.model_dump())]


class StageTracker:
    """Which stage the run is in; `on_step` after every optimizer step moves it on."""

    def __init__(self, stages: list[ResolvedStage]):
        if not stages:
            raise ValueError("StageTracker needs at least one stage")
        self._stages = stages
        self._index = 0
        self.stage_start_step = 1
        """Global (1-based) step of the current stage's first step."""
        self._rewards: deque[float] = deque(maxlen=stages[0].until_window)

    @property
    def stages(self) -> list[ResolvedStage]:
        return list(self._stages)

    @property
    def current(self) -> ResolvedStage:
        return self._stages[self._index]

    @property
    def is_last(self) -> bool:
        return self._index == len(self._stages) - 1

    def on_step(self, step: int, reward_mean: float | None) -> ResolvedStage | None:
        """Record finished global step `step`; return the next stage if this step ended the current."""
        if step < self.stage_start_step:
            raise ValueError(f"step {step} is before the current stage's first step {self.stage_start_step}")
        if self.is_last:
            return None
        stage = self.current
        if reward_mean is not None:
            self._rewards.append(reward_mean)
        steps_done = step - self.stage_start_step + 1
        ended = stage.steps is not None and steps_done >= stage.steps
        if stage.until_reward_mean is not None and len(self._rewards) == stage.until_window:
            ended = ended or sum(self._rewards) / len(self._rewards) >= stage.until_reward_mean
        if not ended:
            return None
        self._index += 1
        self.stage_start_step = step + 1
        self._rewards = deque(maxlen=self.current.until_window)
        return self.current

    def metrics(self) -> dict[str, float]:
        return {"stage/index": self._index, "stage/start_step": self.stage_start_step}

    def state_dict(self) -> dict:
        return {"index": self._index, "stage_start_step": self.stage_start_step, "rewards": list(self._rewards)}

    def load_state_dict(self, state: dict) -> None:
        if not 0 <= state["index"] < len(self._stages):
            raise ValueError(f"saved stage index {state['index']} but the config has {len(self._stages)} stages")
        self._index = state["index"]
        self.stage_start_step = state["stage_start_step"]
        self._rewards = deque(state["rewards"], maxlen=self.current.until_window)


class PassRateTracker:
    """Correct / drawn samples per record key, over the samples of one stage."""

    def __init__(self):
        self._counts: dict[str, list[int]] = {}  # key -> [num_correct, num_samples]

    def add(self, record_key: str, correct: bool) -> None:
        counts = self._counts.setdefault(record_key, [0, 0])
        counts[0] += bool(correct)
        counts[1] += 1

    def pass_rates(self) -> dict[str, float]:
        return {key: c / n for key, (c, n) in self._counts.items()}

    def solved(self) -> set[str]:
        """Keys whose every sample so far was correct (pass rate 1)."""
        return {key for key, (c, n) in self._counts.items() if n > 0 and c == n}

    def reset(self) -> None:
        self._counts.clear()

    def state_dict(self) -> dict:
        return {"counts": {k: list(v) for k, v in self._counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._counts = {k: list(v) for k, v in state["counts"].items()}
