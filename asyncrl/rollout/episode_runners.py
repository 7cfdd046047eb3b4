"""Which episode runner a run's `env` section asks for, built in the process that runs it: a
rollout actor (`episodes_in_actor`) or an offline evaluation (`build_episodes` with `EngineTurns`).

    env.type calculator | python | guess_number | import:...  ─► EpisodeRunner (rollout/episode.py)
    env.type agent                                           ─► AgentRunner (rollout/agent_episode.py)
"""

from __future__ import annotations

from typing import Any

from asyncrl.config.env_section import EnvConfig
from asyncrl.env.registry import env_factory
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.episode import EpisodeRunner, Episodes
from asyncrl.types import Locate


class EngineTurns:
    """What a runner asks of a rollout actor, served by a bare engine that holds one policy (an
    offline evaluation: no weight updates, so no aborts and every token is version 0)."""

    actor_id, version = 0, 0

    def __init__(self, engine: Any):
        self.engine = engine

    async def complete(self, prompt_ids: list[int], spec: SamplingSpec, name: str,
                       abortable: bool = True) -> tuple[list[int], list[float], list[int], str]:
        out = await self.engine.generate(prompt_ids, spec, name)
        return list(out.token_ids), list(out.logprobs), [0] * len(out.token_ids), out.finish_reason


def build_episodes(cfg: EnvConfig, tokenizer: Any, max_model_len: int | None = None) -> Episodes:
    """The runner env.type asks for, in this process: an environment's, or an agent's (whose
    endpoint starts on the running loop at its first episode)."""
    if cfg.type == "agent":
        import os

        from asyncrl.reward.registry import load_function
        from asyncrl.rollout.agent_episode import AgentRunner

        # the agent's client reaches this process's endpoint directly, never through a proxy a
        # cluster's environment names (httpx honours HTTP(S)_PROXY for 127.0.0.1 too)
        os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))
        return AgentRunner(load_function(str(cfg.agent), cfg.import_path, what="agent"), tokenizer,
                           episode_timeout_s=cfg.agent_timeout_s, max_call_tokens=cfg.max_turn_tokens,
                           max_model_len=max_model_len, name=f"agent:{cfg.agent}")
    return EpisodeRunner(cfg, env_factory(cfg), tokenizer)


def episodes_in_actor(cfg: EnvConfig, tokenizer_path: str, locate: Locate | None = None,
                      max_model_len: int | None = None) -> Episodes:
    """`build_episodes` in a rollout actor's process, with the model's tokenizer (`locate`: where
    the model's files are on this node, engine.Locate)."""
    from transformers import AutoTokenizer

    if locate is not None:
        tokenizer_path = locate(tokenizer_path)
    return build_episodes(cfg, AutoTokenizer.from_pretrained(tokenizer_path), max_model_len)
