"""Prompt source: an endless, seeded, resumable stream of tokenized prompts.

Records come from the built-in synthetic task or a jsonl file (read and checked by records.py:
`prompt` or `messages`, `answer`, `data_source` / `domain`, optional `tests` and `metadata`). Each
becomes a `PromptItem` whose metadata carries what verifiers need, plus a `record_key`
(`<source_name>/<index in the file>`) that names the record the same way in every epoch, so the
pass rates of a stage can be tied back to records (online filtering, Skywork-OR1 section 3.1).
File records are shuffled once per epoch with the seed; the cursor (epoch, offset into that
epoch's order) and `position` (records drawn so far, including those skipped as too long,
excluding excluded ones) are what a checkpoint stores (`state_dict`).

`MixturePromptSource` draws each prompt from one of several sources with a seeded RNG in
proportion to weights: a stage's dataset mixture (Skywork-OR1 3.2.2, Ring-lite 3.4).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from asyncrl.data.records import data_source_of
from asyncrl.types import PromptItem


def record_metadata(rec: dict[str, Any], record_key: str) -> dict[str, Any]:
    """What a prompt carries to its verifier (and environment): the record's metadata, answer,
    data source, tests, and its key."""
    meta = dict(rec.get("metadata") or {})
    meta["answer"] = rec.get("answer", rec.get("ground_truth"))
    meta["data_source"] = data_source_of(rec)
    meta["record_key"] = record_key
    if "tests" in rec:
        meta["tests"] = rec["tests"]
    return meta


class PromptSource:
    def __init__(self, records: Iterator[dict[str, Any]] | list[dict[str, Any]], tokenizer: Any,
                 seed: int = 0, apply_chat_template: bool = False, max_prompt_tokens: int | None = None,
                 source_name: str = "data"):
        self._tokenizer = tokenizer
        self._chat = apply_chat_template
        self._max_prompt_tokens = max_prompt_tokens
        self._seed = seed
        self._records = records
        self.source_name = source_name
        self._excluded: set[int] = set()
        self._stream = None if isinstance(records, list) else iter(records)
        self._epoch, self._offset, self._order = 0, 0, None
        self.position = 0
        self.num_skipped_too_long = 0

    @property
    def num_excluded(self) -> int:
        return len(self._excluded)

    @property
    def num_available(self) -> int | None:
        """Records not excluded (None for a streamed source, whose length is unknown)."""
        if not isinstance(self._records, list):
            return None
        return len(self._records) - len(self._excluded)

    def record_key(self, index: int) -> str:
        return f"{self.source_name}/{index}"

    def data_sources(self) -> set[str] | None:
        """The records' data_source / domain values (None for a streamed source), so a reward
        registry can reject a source it has no verifier for before the run starts."""
        if not isinstance(self._records, list):
            return None
        return {data_source_of(rec) for rec in self._records}

    def answers_missing(self) -> tuple[int, int]:
        """(records without an answer, records), (0, 0) for a streamed source: why every group of a
        run can score alike when the label field is misnamed for a reward function."""
        if not isinstance(self._records, list):
            return 0, 0
        return sum(rec.get("answer", rec.get("ground_truth")) is None for rec in self._records), len(self._records)

    def exclude(self, keys: Iterable[str]) -> int:
        """Never hand out these records again (this epoch included); returns how many were newly
        excluded. Keys of other sources are ignored, so a mixture can pass every key to every source."""
        prefix = f"{self.source_name}/"
        num_new = 0
        for key in keys:
            if not key.startswith(prefix) or not key[len(prefix):].isdecimal():
                continue
            index = int(key[len(prefix):])
            if isinstance(self._records, list) and index >= len(self._records):
                continue
            if index not in self._excluded:
                self._excluded.add(index)
                num_new += 1
        return num_new

    def _next_record(self) -> tuple[int, dict[str, Any]]:
        # Exclusions are checked when a record is drawn, so they apply to the rest of the current
        # epoch too; the shuffle covers every index, so excluding records never changes the others' order.
        if self._stream is not None:
            while True:
                i, rec = self._offset, next(self._stream)
                self._offset += 1
                if i not in self._excluded:
                    return i, rec
        if not self._records:
            raise ValueError("the prompt source has no records")
        while True:
            if self._order is None:
                self._order = list(range(len(self._records)))
                random.Random(f"{self._seed}/{self._epoch}").shuffle(self._order)
            if self._offset == len(self._order):
                self._epoch, self._offset, self._order = self._epoch + 1, 0, None
                continue
            i = self._order[self._offset]
            self._offset += 1
            if i not in self._excluded:
                return i, self._records[i]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "epoch": self._epoch, "offset": self._offset,
                "excluded": sorted(self._excluded), "num_skipped_too_long": self.num_skipped_too_long}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the saved source stopped (a streamed source is read again up to there)."""
        self.position = state["position"]
        self._epoch, self._offset, self._order = state["epoch"], state["offset"], None
        self._excluded = set(state["excluded"])
        self.num_skipped_too_long = state["num_skipped_too_long"]
        if self._stream is not None:
            for _ in range(self._offset):
                next(self._stream)

    def _tokenize(self, rec: dict[str, Any]) -> list[int]:
        if "messages" in rec:
            return list(self._tokenizer.apply_chat_template(rec["messages"], tokenize=True,
                                                            add_generation_prompt=True))
        if self._chat:
            return list(self._tokenizer.apply_chat_template(
                [{"role": "user", "content": rec["prompt"]}], tokenize=True, add_generation_prompt=True))
        return list(self._tokenizer.encode(rec["prompt"], add_special_tokens=False))

    def next(self) -> PromptItem:
        num_too_long = 0
        while True:
            available = self.num_available
            if available == 0:
                raise ValueError(f"online filtering removed every prompt of source {self.source_name!r} "
                                 f"(all {self.num_excluded} records were excluded as solved)")
            index, rec = self._next_record()
            self.position += 1
            ids = self._tokenize(rec)
            if self._max_prompt_tokens is not None and len(ids) > self._max_prompt_tokens:
                self.num_skipped_too_long += 1
                num_too_long += 1
                # 2N draws in a row always span a whole epoch: every remaining record is too long.
                if available is not None and num_too_long >= 2 * available:
                    raise ValueError(f"every remaining prompt of source {self.source_name!r} is longer "
                                     f"than max_prompt_tokens={self._max_prompt_tokens}")
                continue
            return PromptItem(prompt_id=f"p{self.position}", prompt_ids=ids, metadata=self._metadata(rec, index))

    def _metadata(self, rec: dict[str, Any], index: int) -> dict[str, Any]:
        return record_metadata(rec, self.record_key(index))

    def take(self, n: int) -> list[PromptItem]:
        return [self.next() for _ in range(n)]

    def all_items(self, id_prefix: str = "") -> list[PromptItem]:
        """Every record once, in file order, without touching the cursor (held-out evaluation);
        prompts too long for the context are left out."""
        items = []
        for index, rec in enumerate(self._records):
            ids = self._tokenize(rec)
            if self._max_prompt_tokens is None or len(ids) <= self._max_prompt_tokens:
                items.append(PromptItem(prompt_id=f"{id_prefix}{index}", prompt_ids=ids,
                                        metadata=self._metadata(rec, index)))
        return items


class MixturePromptSource:
    """Several prompt sources behind the PromptSource interface; each prompt comes from a source
    picked by a seeded RNG in proportion to its weight (among sources with records left)."""

    def __init__(self, sources: list[PromptSource], weights: list[float], seed: int = 0, id_prefix: str = ""):
        if not sources or len(sources) != len(weights):
            raise ValueError(f"a mixture needs one weight per source (got {len(sources)} sources, "
                             f"{len(weights)} weights)")
        if any(w <= 0 for w in weights):
            raise ValueError(f"mixture weights must be positive, got {weights}")
        names = [s.source_name for s in sources]
        if len(set(names)) != len(names):
            # Record keys are <source_name>/<index>: equal names would make two records one key.
            raise ValueError(f"mixture sources need distinct source names, got {names}")
        self.sources = sources
        self.weights = list(weights)
        self._rng = random.Random(seed)
        # Lets a new stage's source hand out ids that cannot collide with the previous source's.
        self._id_prefix = id_prefix

    @property
    def position(self) -> int:
        return sum(s.position for s in self.sources)

    @property
    def num_skipped_too_long(self) -> int:
        return sum(s.num_skipped_too_long for s in self.sources)

    @property
    def num_excluded(self) -> int:
        return sum(s.num_excluded for s in self.sources)

    def exclude(self, keys: Iterable[str]) -> int:
        keys = set(keys)
        return sum(s.exclude(keys) for s in self.sources)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["sources"]) != len(self.sources):
            raise ValueError(f"saved mixture has {len(state['sources'])} sources, this one {len(self.sources)}")
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        for source, st in zip(self.sources, state["sources"]):
            source.load_state_dict(st)

    def data_sources(self) -> set[str] | None:
        found = [s.data_sources() for s in self.sources]
        return None if any(f is None for f in found) else set().union(*found)

    def answers_missing(self) -> tuple[int, int]:
        counts = [s.answers_missing() for s in self.sources]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def next(self) -> PromptItem:
        live = [i for i, s in enumerate(self.sources) if s.num_available != 0]
        if not live:
            raise ValueError(f"online filtering removed every prompt of every source in the mixture "
                             f"({', '.join(s.source_name for s in self.sources)})")
        i = self._rng.choices(live, weights=[self.weights[j] for j in live])[0]
        item = self.sources[i].next()
        # The summed position rises with every prompt, so ids stay unique across sources.
        return replace(item, prompt_id=f"{self._id_prefix}p{self.position}")

    def take(self, n: int) -> list[PromptItem]:
        return [self.next() for _ in range(n)]
