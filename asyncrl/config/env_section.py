"""The `env` section: multi-turn episodes with an environment (asyncrl/env). Off by default: a
run without `env.type` samples one completion per prompt, exactly as before."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from asyncrl.config.section import _Section

BUILTIN_ENVS = ("calculator", "python", "guess_number", "agent")
IMPORT_PREFIX = "import:"


class EnvConfig(_Section):
    type: str | None = None
    """The environment each episode talks to: calculator (`<calc>expr</calc>` answered with its
    value), python (`<python>code</python>` run in the code verifier's sandbox, answered with its
    output), guess_number (higher/lower feedback), `import:package.module:factory` for your own
    (called as `factory(metadata, **env.options)` once per episode; see asyncrl/env/base.py), or
    agent: your own agent program (env.agent) driving the episode through an OpenAI-compatible
    endpoint. None: single-turn sampling."""
    agent: str | None = None
    """With env.type agent: your agent, `package.module:function`, called as
    `function(base_url, metadata)` once per episode; it talks to the policy through the `openai`
    client at `base_url` (an OpenAI-compatible endpoint the rollout actor serves) and returns the
    reward, or None for reward.type to score the final text (asyncrl/rollout/agent_episode.py)."""
    episode_timeout_s: float | None = Field(None, gt=0)
    """With env.type agent: seconds of the agent's own time one episode may take, the time its calls
    spend in the engine not counted (a busy engine is watched by observe.stall_timeout_s). None: what
    an environment's episode may take, max_turns x step_timeout_s (120 s by default)."""
    options: dict[str, Any] = {}
    """Keyword arguments for the environment's factory (e.g. max_calls; the python tool's sandbox)."""
    import_path: list[str] = []
    """Directories searched first for an `import:` environment's module."""
    stop: list[str] | None = None
    """Stop strings that end a model turn; None: the environment's own (its `stop` attribute)."""
    max_turns: int = Field(4, gt=0)
    """Model turns per episode at most; an episode still going then ends as truncated ("length")."""
    max_turn_tokens: int | None = Field(None, gt=0)
    """Tokens one model turn may sample; None: what is left of rollout.max_tokens, which bounds the
    whole response (model and observation tokens together)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Seconds one environment step may take; past it the episode ends with an env error (the
    other episodes and the engine go on). Above the python tool's sandbox wall time (10 s by
    default), so a program that runs out its time is a tool error the model reads, not an env error."""
    max_error_frac: float = Field(0.05, ge=0, le=1)
    """The run stops when more than this fraction of episodes end with an env error (a step that
    raised, timed out or answered something that is not a Step), judged with confidence: from 10
    errors on, when the error rate's 3-sigma lower bound is above it (a tool failing 2% of calls
    goes on against 0.05; an environment that always fails stops at its 10th episode)."""

    @property
    def agent_timeout_s(self) -> float:
        """episode_timeout_s, or its default sized to the episode (its docstring)."""
        return self.episode_timeout_s if self.episode_timeout_s is not None else self.max_turns * self.step_timeout_s

    @field_validator("type")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and v not in BUILTIN_ENVS and not v.startswith(IMPORT_PREFIX):
            raise ValueError(f"unknown environment {v!r} (allowed: {', '.join(BUILTIN_ENVS)}, "
                             f"or {IMPORT_PREFIX}package.module:factory)")
        return v

    @model_validator(mode="after")
    def _agent_named(self) -> "EnvConfig":
        if (self.type == "agent") != (self.agent is not None):
            raise ValueError("env.agent (package.module:function) is set exactly when env.type is agent")
        return self
