"""The run's prompt supply across training stages: which stage it is in, that stage's prompt
source, per-record pass rates and the online filter's exclusions (data/stages.py has the pure
bookkeeping; this object wires it to prompt sources and is what a checkpoint saves of them).

At a stage boundary the sampling settings, Phi and data change from the next admission on;
prompts already admitted finish with the settings they were admitted with. Online filtering drops
the prompts every sample of which was correct in the stage that ended (Skywork-OR1 section 3.1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from asyncrl.config import Config
from asyncrl.data.stages import PassRateTracker, ResolvedStage, StageTracker, resolve_stages, stage_mixture
from asyncrl.reward.registry import route
from asyncrl.types import PromptItem


@dataclass
class StageChange:
    stage: ResolvedStage
    prompts_excluded: int
    solved_in_previous: int

    def describe(self) -> dict[str, Any]:
        """The fields of the run's `stage` event."""
        return {"name": self.stage.name, "index": self.stage.index, "prompts_excluded": self.prompts_excluded,
                "solved_in_previous": self.solved_in_previous}

    def __str__(self) -> str:
        st = self.stage
        return (f"entering stage {st.name} (max_tokens {st.max_tokens}, group {st.group_size}, temperature "
                f"{st.temperature}, Phi {st.token_budget})"
                + (f"; online filter dropped {self.prompts_excluded} solved prompts" if st.online_filter else ""))


class StageRunner:
    def __init__(self, cfg: Config, model_path: str):
        from transformers import AutoTokenizer

        self.cfg, self.tokenizer = cfg, AutoTokenizer.from_pretrained(model_path)
        self.tracker = StageTracker(resolve_stages(cfg))
        self.pass_rates = PassRateTracker()
        self.excluded: set[str] = set()  # record keys dropped by online filtering, all stages
        self._source_stage = 0  # the stage whose settings built the current source
        self.source = self.source_for(self.current)

    @property
    def current(self) -> ResolvedStage:
        return self.tracker.current

    def source_for(self, stage: ResolvedStage):
        from asyncrl.data.build import build_stage_source

        # each stage shuffles its data with its own seed, so a rebuilt source does not replay the
        # previous stage's prompt order
        mixture = [m.model_copy(update={"seed": m.seed + stage.index}) for m in stage_mixture(stage, self.cfg.data)]
        return build_stage_source(mixture, self.tokenizer, self.cfg.model.max_model_len - stage.max_tokens,
                                  seed=self.cfg.seed + stage.index,
                                  id_prefix=f"s{stage.index}-" if stage.index else "",
                                  verifier_of=functools.partial(route, self.cfg.reward))

    def data_sources(self) -> set[str]:
        """Every data source of every stage's data (for a reward router without a default)."""
        found: set[str] = set()
        for st in self.tracker.stages:
            found |= self.source_for(st).data_sources() or set()
        return found

    def take(self, k: int) -> list[PromptItem]:
        return self.source.take(k)

    def record(self, metadata: dict[str, Any], reward: float) -> None:
        if "record_key" in metadata:
            self.pass_rates.add(metadata["record_key"], reward >= 1.0)

    def on_step(self, step: int, reward_mean: float | None) -> StageChange | None:
        """After optimizer step `step`: the new stage if it ended the current one."""
        old = self.current
        stage = self.tracker.on_step(step, reward_mean)
        if stage is None:
            return None
        solved = self.pass_rates.solved()
        self.pass_rates.reset()
        before = len(self.excluded)
        if stage.online_filter:
            self.excluded |= solved
        if stage.data is not None or old.data is not None or stage.max_tokens != old.max_tokens:
            self.source = self.source_for(stage)  # max_tokens bounds the prompt length too
            self._source_stage = stage.index
        self.source.exclude(self.excluded)  # a rebuilt source keeps earlier stages' exclusions
        return StageChange(stage, len(self.excluded) - before, len(solved))

    def metrics(self) -> dict[str, float]:
        return {**self.tracker.metrics(), "data/prompts_filtered_total": len(self.excluded)}

    def state_dict(self) -> dict[str, Any]:
        return {"tracker": self.tracker.state_dict(), "pass_rates": self.pass_rates.state_dict(),
                "excluded": sorted(self.excluded), "source_stage": self._source_stage,
                "source": self.source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state["tracker"])
        self.pass_rates.load_state_dict(state["pass_rates"])
        self.excluded = set(state["excluded"])
        self._source_stage = state["source_stage"]
        self.source = self.source_for(self.tracker.stages[self._source_stage])
        self.source.load_state_dict(state["source"])
