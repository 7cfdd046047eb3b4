"""Builds the prompt source a config asks for: the run's data section, or a stage's mixture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.config import DataConfig, DataMixConfig
from asyncrl.data.prompt_source import MixturePromptSource, PromptSource
from asyncrl.data.records import read_records

BUILTIN_TASKS = ("tiny_arith", "tiny_calc")
"""Data types whose records the project generates (asyncrl/tiny): each has a held-out split."""


def source_name_of(cfg: DataConfig) -> str:
    """The name in a dataset's record keys. It depends only on which records the dataset holds, so
    the same dataset in two stages (or as the run's data section) gives the same keys, and a
    stage's online filter can exclude records solved while drawing from another source object."""
    if cfg.type in BUILTIN_TASKS:
        return cfg.type  # the problem set is fixed; data.seed only orders it
    return f"{cfg.type}:{cfg.path}"


def load_records(cfg: DataConfig, verifier_of: Callable[[str], str | None] | None = None,
                 split: str = "train", path: str | None = None) -> list[dict[str, Any]]:
    """The dataset's records, checked (records.py); `split` picks the built-in task's side, `path`
    reads another jsonl with the same field names (held-out data)."""
    if path is None and cfg.type == "tiny_arith":
        from asyncrl.tiny.task import TinyTaskSpec, all_problems, make_record

        return [make_record(*p) for p in all_problems(TinyTaskSpec(), split)]
    if path is None and cfg.type == "tiny_calc":
        from asyncrl.tiny import tool_task

        return [tool_task.make_record(*p) for p in tool_task.all_problems(split)]
    return read_records(path or cfg.path, cfg.prompt_field, cfg.answer_field, verifier_of)


def build_prompt_source(cfg: DataConfig, tokenizer: Any, max_prompt_tokens: int,
                        verifier_of: Callable[[str], str | None] | None = None) -> PromptSource:
    return PromptSource(load_records(cfg, verifier_of), tokenizer, seed=cfg.seed,
                        apply_chat_template=cfg.apply_chat_template, max_prompt_tokens=max_prompt_tokens,
                        source_name=source_name_of(cfg))


def build_stage_source(mixture: list[DataMixConfig], tokenizer: Any, max_prompt_tokens: int, seed: int,
                       id_prefix: str = "", verifier_of: Callable[[str], str | None] | None = None
                       ) -> MixturePromptSource:
    """One source per mixture entry, drawn in proportion to their weights. Always a mixture (even of
    one) so every stage's source has the same interface; `id_prefix` (e.g. "s1-") keeps a new
    stage's prompt ids apart from those of prompts still in flight from the previous stage."""
    if not mixture:
        raise ValueError("a stage's data mixture is empty")
    names = [source_name_of(m) for m in mixture]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"a stage's mixture lists the same dataset twice ({', '.join(duplicates)}); "
                         f"give it one entry with the summed weight")
    sources = [build_prompt_source(m, tokenizer, max_prompt_tokens, verifier_of) for m in mixture]
    return MixturePromptSource(sources, [m.weight for m in mixture], seed=seed, id_prefix=id_prefix)
