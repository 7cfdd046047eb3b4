"""A saved policy evaluated outside training, on its run's data: what evaluate.py and sample.py
share.

    policy dir ─► load_run_config (the config.yaml of the run it belongs to)
               ─► held_out_records (--data, else the run's own: eval_records)
               ─► sample_and_score: a vLLM engine in this process (its own, or one shared by
                  many policies: offline/policy_engine.py), n samples per prompt, rewards from
                  a RewardPool of the run's verifiers (so their timeouts apply)
               ─► summarize: avg@n and pass@k (algo/pass_at_k.py), overall and per data_source

The records, prompt tokenization, verifiers and metrics are the in-training evaluation's
(orchestrator/evaluation.py), so the figures here and a run's eval/avg@n agree for the same policy
up to sampling noise. difficulty_filter.py and checkpoint_entropy.py sample and score through the
same functions.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from asyncrl.algo.pass_at_k import eval_metrics
from asyncrl.config import Config, ConfigError, load_config
from asyncrl.data.build import load_records
from asyncrl.data.prompt_source import PromptSource
from asyncrl.data.records import data_source_of
from asyncrl.preflight import model_context, resolve
from asyncrl.reward.episode_reward import verifier_metadata
from asyncrl.reward.registry import route
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.episode_runners import EngineTurns, build_episodes
from asyncrl.types import EpisodeRecord, PromptItem


@dataclass
class EvalSample:
    """One response to one record, from generation to its reward."""

    record_index: int
    prompt: Any
    """The record's prompt (its `messages` for chat records), for reports."""
    metadata: dict[str, Any]
    response: str
    num_tokens: int
    finish_reason: str
    reward: float = 0.0
    info: dict[str, Any] | None = None
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    token_ids: list[int] = field(default_factory=list, repr=False)
    logprobs: list[float] = field(default_factory=list, repr=False)
    """Behaviour logprob of each response token, at the sampling temperature (as in rollouts)."""
    episode: EpisodeRecord | None = None
    """The episode's record, for an environment's task."""

    @property
    def data_source(self) -> str:
        return self.metadata["data_source"]

    @property
    def outcome(self) -> str | None:
        return (self.info or {}).get("outcome")


def run_config_path(model: str | Path) -> Path | None:
    """The config.yaml of the run a policy belongs to: `<run>/final/` or
    `<run>/checkpoints/step_N/learner/policy/` (None for any other directory)."""
    model = Path(model).absolute()
    if model.name == "final":
        found = model.parent / "config.yaml"
    elif model.name == "policy" and model.parent.name == "learner":
        found = model.parent.parent / "config.yaml"
    else:
        return None
    return found if found.is_file() else None


def load_run_config(model: str, config: str | None = None,
                    say: Callable[[str], None] = print) -> tuple[Config, Path | None]:
    """The config to evaluate `model` under (`config`, else its run's, else the default) and the
    file it came from; model.path is `model` (`builtin:tiny`: the cached tiny model's directory),
    max_model_len resolved, and the engine vLLM whatever the run used (a fake one has no policy)."""
    from asyncrl.orchestrator.components import resolve_model_path

    model_context(model)  # a missing or non-model directory: ConfigError, not a vLLM traceback
    path = Path(config) if config else run_config_path(model)
    cfg = load_config(path)
    cfg = resolve(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model})}))
    directory = resolve_model_path(cfg, log=say)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": directory}),
                                  "rollout": cfg.rollout.model_copy(update={"engine": "vllm"})}), path


def held_out_records(cfg: Config, data: str | None = None,
                     max_prompts: int | None = None) -> list[dict[str, Any]] | None:
    """`data` (a jsonl with the run's field names, checked for its verifiers), else the run's own
    held-out records; the first `max_prompts` (default: the run's eval.max_prompts for its own).
    None: the run has none (jsonl data without eval.data)."""
    from asyncrl.orchestrator.evaluation import eval_records  # imports Ray

    if data:
        return load_records(cfg.data, functools.partial(route, cfg.reward), path=data)[:max_prompts]
    # eval_records says None for a run that switched evaluation off; its held-out data is still there.
    ev = cfg.eval.model_copy(update={"every_steps": cfg.eval.every_steps or 1,
                                     "max_prompts": max_prompts or cfg.eval.max_prompts})
    return eval_records(cfg.model_copy(update={"eval": ev}))


def train_records(cfg: Config) -> list[dict[str, Any]]:
    return load_records(cfg.data, functools.partial(route, cfg.reward))


def prompt_items(cfg: Config, tokenizer: Any, records: list[dict[str, Any]], max_tokens: int) -> list[PromptItem]:
    """One item per record whose prompt leaves `max_tokens` in the context (prompt_id: the
    record's index), tokenized as the run's rollouts are."""
    room = cfg.model.max_model_len - max_tokens
    source = PromptSource(records, tokenizer, apply_chat_template=cfg.data.apply_chat_template,
                          max_prompt_tokens=room, source_name="eval")
    items = source.all_items()
    if not items:
        raise ConfigError(f"no prompt fits the context: every one is longer than model.max_model_len "
                          f"({cfg.model.max_model_len}) - max_tokens ({max_tokens}) = {room} tokens")
    return items


class Progress:
    """A line every `every_s` seconds while a phase runs; a short phase says nothing."""

    def __init__(self, what: str, total: int, say: Callable[[str], None], every_s: float = 10.0):
        self.what, self.total, self.say, self.every_s = what, total, say, every_s
        self.done = 0
        self.t0 = self.last = time.monotonic()

    def add(self, k: int = 1) -> None:
        self.done += k
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.say(f"  {self.what} {self.done}/{self.total} ({now - self.t0:.0f} s)")


async def sample_and_score(cfg: Config, records: list[dict[str, Any]], n: int, spec: SamplingSpec,
                           say: Callable[[str], None] = print, engine: Any = None,
                           pool: Any = None) -> list[EvalSample]:
    """n samples of every record that fits the context (a record's n in a row), scored.

    `engine`: a started engine holding cfg.model.path's policy (offline/policy_engine.py, shared
    by the policies of a run or a study), else one is started here for this call. `pool`: a
    reward pool of cfg.reward's verifiers to reuse, else one is started here."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    items = prompt_items(cfg, tokenizer, records, spec.max_tokens)
    # Started first: its workers import and warm the verifiers while vLLM loads.
    own_pool = pool is None
    if own_pool:
        pool = reward_pool(cfg, records)
    try:
        samples = await generate(cfg, records, items, n, spec, tokenizer, say, engine)
        _score(pool, samples, say)
    finally:
        if own_pool:
            pool.close()
    return samples


def reward_pool(cfg: Config, records: list[dict[str, Any]]) -> Any:
    """A reward pool of the run's verifiers for these records (close it when done)."""
    from asyncrl.reward.registry import build_reward_pool

    return build_reward_pool(cfg.reward, lambda: {data_source_of(r) for r in records})


async def generate(cfg: Config, records: list[dict[str, Any]], items: list[PromptItem], n: int,
                   spec: SamplingSpec, tokenizer: Any, say: Callable[[str], None],
                   engine: Any = None) -> list[EvalSample]:
    """n samples of each item, unscored, with their tokens' behaviour logprobs."""
    import asyncio

    from asyncrl.lab.offline.policy_engine import PolicyEngine

    own_engine = engine is None
    if own_engine:
        engine = PolicyEngine(cfg, say)
        await engine.load(cfg.model.path)
    progress = Progress("generated", len(items) * n, say)
    base_seed = cfg.seed if spec.seed is None else spec.seed
    episodes = build_episodes(cfg.env, tokenizer, cfg.model.max_model_len) if cfg.env.type else None

    async def one(request: int, item: PromptItem) -> EvalSample:
        # A seed per request: the same seed on the n requests of a prompt would give n equal samples.
        seeded = replace(spec, seed=base_seed + request)
        if episodes is not None:  # an environment's task: one episode, as in training
            s = await episodes.run(EngineTurns(engine), item, request, seeded, f"eval-{request}")
            token_ids, logprobs, reason, episode = list(s.response_ids), list(s.logprobs), s.finish_reason, s.episode
        else:
            out = await engine.generate(item.prompt_ids, seeded, f"eval-{request}")
            token_ids, logprobs, reason, episode = out.token_ids, out.logprobs, out.finish_reason, None
        progress.add()
        index = int(item.prompt_id)
        rec = records[index]
        return EvalSample(index, rec.get("prompt", rec.get("messages")), item.metadata,
                          tokenizer.decode(token_ids, skip_special_tokens=True), len(token_ids),
                          reason, prompt_ids=item.prompt_ids, token_ids=token_ids, logprobs=logprobs, episode=episode)

    try:
        requests = itertools.chain.from_iterable(itertools.repeat(item, n) for item in items)
        return list(await asyncio.gather(*[one(i, item) for i, item in enumerate(requests)]))
    finally:
        if episodes is not None:
            close = getattr(episodes, "aclose", None)
            await close() if close is not None else episodes.close()
        if own_engine:
            await engine.shutdown()


def _score(pool: Any, samples: list[EvalSample], say: Callable[[str], None]) -> None:
    for i, s in enumerate(samples):
        pool.submit(i, s.response, verifier_metadata(s.metadata, s.episode))
    progress = Progress("scored", len(samples), say)
    while progress.done < len(samples):
        results = pool.poll(1.0)
        for r in results:
            samples[r.key].reward, samples[r.key].info = r.reward, r.info
        progress.add(len(results))


def summarize(samples: list[EvalSample], n: int, ks: list[int]) -> dict[str, Any]:
    """avg@n and pass@k over every record, and per data_source (`by_source`), with the mean
    response length and the verifiers' outcome counts."""
    by_record: dict[int, list[float]] = defaultdict(list)
    source_of: dict[int, str] = {}
    for s in samples:
        by_record[s.record_index].append(s.reward)
        source_of[s.record_index] = s.data_source
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for index, rewards in by_record.items():
        by_source[source_of[index]].append(rewards)
    out = {**eval_metrics(list(by_record.values()), n, ks),
           "by_source": {src: eval_metrics(r, n, ks) for src, r in sorted(by_source.items())},
           "mean_response_tokens": sum(s.num_tokens for s in samples) / len(samples),
           "outcomes": dict(Counter(str(s.outcome) for s in samples).most_common())}
    tools = [(e.tool_calls > 0, not e.tool_errors and s.reward > 0) for s in samples if (e := s.episode) is not None]
    if tools:  # as the in-training evaluation reports them (orchestrator/evaluation.py)
        out["tool_call_rate"] = sum(c for c, _ in tools) / len(tools)
        out["tool_success_rate"] = sum(c and ok for c, ok in tools) / len(tools)
    return out
