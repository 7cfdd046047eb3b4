"""The verifier registry: names from `RewardConfig` to verifiers, and the per-sample router.

    metadata["data_source"] (else ["domain"]) ─► cfg.by_source.get(source, cfg.type) ─► verifier

Names: math_verify, code, answer_tag, multiple_choice, episode (the reward an environment gave
during the episode, reward/episode_reward.py), or `import:package.module:function` for a user
function called as `fn(response, metadata)` that returns (reward, info) or a bare number. An
episode whose environment failed (rollout/episode.py) is scored 0 with outcome `env_error` before
any verifier sees it.
Everything is imported and built when the router is built (once per reward worker, at start), so a
misspelt module is a config error then, not a crash mid-run; heavy verifiers are imported only when
a config names them.

What the router returns, whatever the verifier did:

- info always holds `outcome`, `verifier` (the name, None when none applies) and `data_source`.
- A verifier that raises gives reward 0, outcome `verifier_error`, `error` (its repr, cut to
  ERROR_CHARS) and `traceback`; the reward pool also guards against hangs and crashes, this is
  defence in depth. The orchestrator reports such errors and stops past reward.max_error_frac.
- A reward that is not a real number or not finite (NaN, inf, a string, a tensor), or a result
  that is not a number or a (reward, dict) pair, gives reward 0 and outcome `bad_reward`. Other
  numbers (a bool counts as 0/1) pass through unclipped: a custom function may shape rewards below
  0 or above 1 on purpose.
- A source with no verifier (reward.type None and the source not in by_source) gives reward 0 and
  outcome `no_verifier`; `check_sources` turns that into an error at start for a known dataset,
  and `check_functions` imports the user functions there.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from asyncrl.config import BUILTIN_VERIFIERS, ConfigError, RewardConfig
from asyncrl.reward.base import RewardFn
from asyncrl.reward.episode_reward import env_failure, episode_reward
from asyncrl.reward.pool import PRELOAD, RewardPool
from asyncrl.reward.text_rewards import AnswerTagReward, MultipleChoiceReward

IMPORT_PREFIX = "import:"
ERROR_CHARS = 500
TRACEBACK_CHARS = 4000


class CustomReward:
    """A user function as a verifier: a bare number r becomes (r, {"outcome": "custom"}) and an
    info without an outcome gets outcome "custom"; the router validates the rest."""

    def __init__(self, fn: Callable[..., Any], path: str):
        self.fn = fn
        self.path = path

    def __call__(self, response: str, metadata: dict[str, Any]) -> tuple[Any, Any]:
        result = self.fn(response, metadata)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            info = dict(result[1])  # the function may return the same dict every time
            info.setdefault("outcome", "custom")
            return result[0], info
        if isinstance(result, tuple):
            return result
        return result, {"outcome": "custom"}


def load_function(path: str, import_path: Iterable[str] = (), what: str = "reward function") -> Callable[..., Any]:
    """The callable named by `package.module:function` (the attribute may be dotted), its module
    searched in `import_path` (reward.import_path) first; raises ValueError naming the path when it
    cannot be imported or is not callable."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r}: expected package.module:function")
    for directory in reversed(list(import_path)):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or any error raised while the module runs
        where = f" (looked in {', '.join(import_path)} first)" if import_path else ""
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}{where}: {e!r}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {path!r}: {attr!r} is not callable")
    return obj


def build_verifier(name: str, cfg: RewardConfig) -> RewardFn:
    """The verifier called `name` (see the module docstring); raises ValueError for an unknown
    name or a user function that cannot be loaded."""
    if name == "math_verify":
        from asyncrl.reward.math_reward import MathReward

        return MathReward()
    if name == "code":
        from asyncrl.reward.code_reward import CodeReward

        return CodeReward(cfg.code, time_budget_s=0.9 * cfg.timeout_s)  # finish before the pool kills
    if name == "answer_tag":
        return AnswerTagReward()
    if name == "multiple_choice":
        return MultipleChoiceReward()
    if name == "episode":
        return episode_reward
    if name.startswith(IMPORT_PREFIX):
        path = name[len(IMPORT_PREFIX):]
        return CustomReward(load_function(path, cfg.import_path), path)
    raise ValueError(f"unknown verifier {name!r} (allowed: {', '.join(BUILTIN_VERIFIERS)}, "
                     f"or {IMPORT_PREFIX}package.module:function)")


def route(cfg: RewardConfig, data_source: Any) -> str | None:
    """The verifier name for a data source: its by_source entry, else the default (maybe None)."""
    if isinstance(data_source, str) and data_source in cfg.by_source:
        return cfg.by_source[data_source]
    return cfg.type


def check_sources(cfg: RewardConfig, sources: Iterable[str]) -> None:
    """Raise ConfigError listing every data source that no verifier would score (possible only
    when reward.type is None); called at start with the dataset's sources."""
    missing = sorted({str(s) for s in sources if route(cfg, s) is None})
    if missing:
        raise ConfigError(f"no verifier for data source(s) {', '.join(map(repr, missing))}: add them "
                          "to reward.by_source or set a default reward.type")


def check_functions(cfg: RewardConfig) -> None:
    """Import every user reward function the config names, raising ConfigError naming the field
    for one that cannot be loaded; at start, in the driver, so it is not a worker's crash later.
    (The built-in verifiers are imported where they run, in the reward workers.)"""
    fields = [("reward.type", cfg.type)] + [(f"reward.by_source.{k}", v) for k, v in cfg.by_source.items()]
    for where, name in fields:
        if name is not None and name.startswith(IMPORT_PREFIX):
            try:
                load_function(name[len(IMPORT_PREFIX):], cfg.import_path)
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from e


class _ReadLog(dict):
    """Metadata that notes which keys a function looked at."""

    def __init__(self, data: dict[str, Any]):
        super().__init__(data)
        self.read: set[Any] = set()

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: Any) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def reads_answer(cfg: RewardConfig, timeout_s: float = 2.0) -> set[str]:
    """The `import:` verifier names whose function reads metadata["answer"] when called once on an
    empty response (in a thread, given up after `timeout_s`): their records need an answer, checked
    before the run like the built-in verifiers' (a missing label would score 0 forever). A function
    that raises before it reads the answer is not counted: the check is a probe, not a proof."""
    names = {cfg.type, *cfg.by_source.values()} - {None}
    found = set()
    for name in sorted(n for n in names if n.startswith(IMPORT_PREFIX)):
        fn = load_function(name[len(IMPORT_PREFIX):], cfg.import_path)
        meta = _ReadLog({"answer": "0", "data_source": "unknown", "record_key": "preflight/0"})

        def call(fn=fn, meta=meta):
            try:
                fn("", meta)
            except Exception:  # an empty response may well be refused; what it read so far counts
                pass

        probe = threading.Thread(target=call, name="reads-answer", daemon=True)
        probe.start()
        probe.join(timeout_s)
        if "answer" in meta.read:
            found.add(name)
    return found


def _source_of(metadata: Any) -> Any:
    if not isinstance(metadata, dict):
        return None
    source = metadata.get("data_source")
    return metadata.get("domain") if source is None else source


def validate_result(result: Any) -> tuple[float, dict[str, Any]]:
    """(reward, info) as the protocol promises, or (0, bad_reward) when the result breaks it."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        return 0.0, {"outcome": "bad_reward", "error": f"not a (reward, info dict) pair: {_short(result)}"}
    reward, info = result
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        error = f"reward is not a finite number: {_short(reward)}"
        return 0.0, {**info, "outcome": "bad_reward", "error": error}
    info.setdefault("outcome", "unknown")
    return float(reward), info


def _short(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception as e:  # a broken __repr__ must not break the report of the error
        text = f"<unprintable {type(obj).__name__}: {type(e).__name__}>"
    return text[:ERROR_CHARS]


class RewardRouter:
    """Scores each sample with the verifier its data source is routed to (`RewardFn`); builds
    each named verifier once, so build it where it will run (in a reward worker)."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        names = {cfg.type, *cfg.by_source.values()} - {None}
        self.verifiers: dict[str, RewardFn] = {name: build_verifier(name, cfg) for name in sorted(names)}

    def verifier_for(self, data_source: str) -> str | None:
        """The verifier name for a data source, None when none applies."""
        return route(self.cfg, data_source)

    def __call__(self, response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        source = _source_of(metadata)
        name = route(self.cfg, source)
        failed = env_failure(metadata)
        if failed is not None:
            reward, info = 0.0, failed
        elif name is None:
            reward, info = 0.0, {"outcome": "no_verifier"}
        else:
            try:
                reward, info = validate_result(self.verifiers[name](response, metadata))
            except Exception as e:  # a verifier bug costs this sample; reward/errors.py makes it loud
                reward, info = 0.0, {"outcome": "verifier_error", "error": _short(e),
                                     "traceback": traceback.format_exc()[-TRACEBACK_CHARS:]}
        info["verifier"] = name if failed is None else info["verifier"]  # env_error names the environment
        info["data_source"] = source
        return reward, info


def reward_pool(cfg: RewardConfig, num_workers: int | None = None) -> RewardPool:
    """A RewardPool that scores with this config's verifiers (`num_workers` of them, default
    reward.num_workers); its forkserver preloads the code sandbox only if code is scored."""
    scores_code = "code" in {cfg.type, *cfg.by_source.values()}
    preload = PRELOAD + (("asyncrl.reward.sandbox.preload",) if scores_code else ())
    return RewardPool(functools.partial(RewardRouter, cfg), num_workers or cfg.num_workers, cfg.timeout_s,
                      preload=preload)


def build_reward_pool(cfg: RewardConfig, data_sources) -> RewardPool:
    """The reward pool, after the checks that need the data: user functions import, and without a
    default verifier every data source (`data_sources()`) is routed (ConfigError otherwise)."""
    check_functions(cfg)
    if cfg.type is None:
        check_sources(cfg, data_sources())
    # under placement "actor" it scores evaluation samples only: the actors score their own
    return reward_pool(cfg, 1 if cfg.placement == "actor" else cfg.num_workers)
