"""Names from `EnvConfig.type` to environment factories, and the check at start.

A built-in name maps to a class in this package; `import:package.module:factory` loads the user's
factory the way reward functions load (reward/registry.py `load_function`). `check_env` builds one
environment from a real prompt record before anything starts, so a misspelt module, a factory that
rejects its options or an object without `step` is a config error naming env.type, not a run that
hangs or fails episode by episode.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.config.env_section import IMPORT_PREFIX, EnvConfig
from asyncrl.env.base import EnvFactory

BUILTINS = {"calculator": "asyncrl.env.calculator:Calculator", "python": "asyncrl.env.python_tool:PythonTool",
            "guess_number": "asyncrl.env.guess_number:GuessNumber"}


def env_factory(cfg: EnvConfig) -> EnvFactory:
    """The factory env.type names; ValueError when it cannot be loaded."""
    if cfg.type in BUILTINS:
        module, _, name = BUILTINS[cfg.type].partition(":")
        return getattr(importlib.import_module(module), name)
    from asyncrl.reward.registry import load_function

    return load_function(str(cfg.type)[len(IMPORT_PREFIX):], cfg.import_path, what="environment")


def stop_strings(cfg: EnvConfig, env: Any) -> tuple[str, ...]:
    """env.stop, else the environment's own `stop`."""
    stop = cfg.stop if cfg.stop is not None else getattr(env, "stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise TypeError(f"stop must be a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def check_env(cfg: EnvConfig, metadata: dict[str, Any]) -> None:
    """Load the factory and build one environment for a prompt record's `metadata`; raise
    ConfigError naming env.type when that fails or the object is not an environment."""
    where = f"env.type={cfg.type!r}"
    try:
        env = env_factory(cfg)(metadata, **cfg.options)
    except Exception as e:  # any error a user's module or factory raises
        raise ConfigError(f"{where}: cannot build an environment for the first prompt record "
                          f"(options {cfg.options}): {type(e).__name__}: {e}") from e
    if not callable(getattr(env, "step", None)):
        raise ConfigError(f"{where}: the factory returned {type(env).__name__}, which has no step(turn) method")
    try:
        stop_strings(cfg, env)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e
    if len(inspect.signature(env.step).parameters) != 1:
        raise ConfigError(f"{where}: step must take one argument, the model's turn (asyncrl.env.base.Turn)")


def check_agent(cfg: EnvConfig) -> None:
    """env.agent imports and takes (base_url, metadata); ConfigError naming env.agent otherwise."""
    from asyncrl.reward.registry import load_function

    try:
        agent = load_function(str(cfg.agent), cfg.import_path, what="agent")
    except ValueError as e:
        raise ConfigError(f"env.agent: {e}") from e
    try:
        inspect.signature(agent).bind("http://127.0.0.1:1/v1", {})
    except TypeError as e:
        raise ConfigError(f"env.agent={cfg.agent!r} must take (base_url, metadata): {e}") from e
    except ValueError:  # a builtin without a signature: it is called and fails as an episode error
        pass
