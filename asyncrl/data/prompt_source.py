"""Prompt source: an endless, seeded, resumable stream of tokenized prompts.

Records come from the built-in synthetic task or a jsonl file (fields: `prompt` or `messages`,
`answer` / `ground_truth`, `data_source` / `domain`, optional `tests` and `metadata`). Each
becomes a `PromptItem` whose metadata carries what verifiers need. File records are shuffled
once per epoch with the seed; `position` (records handed out so far) is what a checkpoint stores.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.types import PromptItem


class PromptSource:
    def __init__(self, records: Iterator[dict[str, Any]] | list[dict[str, Any]], tokenizer: Any,
                 seed: int = 0, apply_chat_template: bool = False, max_prompt_tokens: int | None = None):
        self._tokenizer = tokenizer
        self._chat = apply_chat_template
        self._max_prompt_tokens = max_prompt_tokens
        self._seed = seed
        self._records = records
        self._iter = self._cycle()
        self.position = 0
        self.num_skipped_too_long = 0

    def _cycle(self) -> Iterator[dict[str, Any]]:
        if not isinstance(self._records, list):
            yield from self._records
            return
        if not self._records:
            raise ValueError("the prompt source has no records")
        epoch = 0
        while True:
            order = list(range(len(self._records)))
            random.Random(f"{self._seed}/{epoch}").shuffle(order)
            for i in order:
                yield self._records[i]
            epoch += 1

    def _tokenize(self, rec: dict[str, Any]) -> list[int]:
        if "messages" in rec:
            return list(self._tokenizer.apply_chat_template(rec["messages"], tokenize=True,
                                                            add_generation_prompt=True))
        if self._chat:
            return list(self._tokenizer.apply_chat_template(
                [{"role": "user", "content": rec["prompt"]}], tokenize=True, add_generation_prompt=True))
        return list(self._tokenizer.encode(rec["prompt"], add_special_tokens=False))

    def next(self) -> PromptItem:
        while True:
            rec = next(self._iter)
            self.position += 1
            ids = self._tokenize(rec)
            if self._max_prompt_tokens is not None and len(ids) > self._max_prompt_tokens:
                self.num_skipped_too_long += 1
                continue
            meta = dict(rec.get("metadata") or {})
            meta["answer"] = rec.get("answer", rec.get("ground_truth"))
            meta["data_source"] = rec.get("data_source", rec.get("domain", "unknown"))
            if "tests" in rec:
                meta["tests"] = rec["tests"]
            return PromptItem(prompt_id=f"p{self.position}", prompt_ids=ids, metadata=meta)

    def take(self, n: int) -> list[PromptItem]:
        return [self.next() for _ in range(n)]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a jsonl file; a line that is not a JSON object is an error naming the line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(rec, dict) or not ("prompt" in rec or "messages" in rec):
                raise ValueError(f"{path}:{lineno}: a record needs a 'prompt' or 'messages' field")
            records.append(rec)
    return records
