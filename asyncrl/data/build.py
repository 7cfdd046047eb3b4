"""Builds the prompt source a config asks for."""

from __future__ import annotations

from typing import Any

from asyncrl.config import DataConfig
from asyncrl.data.prompt_source import PromptSource, read_jsonl


def build_prompt_source(cfg: DataConfig, tokenizer: Any, max_prompt_tokens: int) -> PromptSource:
    if cfg.type == "tiny_arith":
        from asyncrl.tiny.task import TinyTaskSpec, all_problems, make_record

        records = [make_record(*p) for p in all_problems(TinyTaskSpec(), "train")]
    elif cfg.type == "jsonl":
        records = read_jsonl(cfg.path)
    else:
        raise ValueError(f"unknown data.type {cfg.type!r}")
    return PromptSource(records, tokenizer, seed=cfg.seed, apply_chat_template=cfg.apply_chat_template,
                        max_prompt_tokens=max_prompt_tokens)
