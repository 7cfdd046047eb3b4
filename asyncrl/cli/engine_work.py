"""What the commands that start their own vLLM engine (evaluate, sample, filter-difficulty,
choose-checkpoint) share around their work: a quiet engine, the torch-extras work-around before
transformers and vLLM load (asyncrl/compat.py), and a config mistake as one line."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_engine_work(work: Callable[[], T]) -> T | None:
    """`work()`'s result; None after printing the error when it raised ConfigError (exit 2)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.config import ConfigError

    hide_broken_torch_extras()
    try:
        return work()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
