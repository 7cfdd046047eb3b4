"""Response texts for the verifiers: token ids decoded many at a time, where the samples arrive
(the driver's intake, or a rollout actor that scores its own samples)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.types import IntSeq, as_list


def batch_decoder(tokenizer: Any) -> Callable[[list[IntSeq]], list[str]]:
    """Texts of many responses at once, each what `tokenizer.decode(ids, skip_special_tokens=True)`
    gives. A fast tokenizer that does not clean up spaces afterwards decodes them in one call to its
    Rust backend, without transformers' per-call (and per-token) Python work: about a third of the
    time per sample here; any other tokenizer decodes one at a time."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda batch: backend.decode_batch(list(map(as_list, batch)), skip_special_tokens=True)
    return lambda batch: [tokenizer.decode(as_list(ids), skip_special_tokens=True) for ids in batch]
