"""Where an offline tool's vLLM engine writes: a log file, not the tool's console.

A training run's engines live in Ray actors whose output goes to the run's log files. The offline
tools (evaluate, sample_policy, choose_checkpoint) start their engine in their own process, and
on CPU its start alone printed some twenty lines of warnings, deprecation notices and progress
bars (from the engine core and worker processes vLLM spawns, from C++ and from `print`) among the
tool's results. Two redirects send all of it to one file:

- while the engine starts or shuts down, this process's stdout and stderr file descriptors point
  at the file, so the processes it spawns inherit the file for their whole life;
- between the two, the vLLM logger of this process writes to the file too (its first `generate`
  and its shutdown log a warning each).

The tool says where the file is. How much vLLM logs is its own VLLM_LOGGING_LEVEL, which the
tools default to WARNING. One line still reaches the console at exit: multiprocessing's resource
tracker, started before the engine, warns about the shared memory of the engine vLLM kills.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def default_log_path() -> Path:
    return Path(tempfile.gettempdir()) / f"asyncrl-vllm-{os.getpid()}.log"


@contextmanager
def output_to(log: IO) -> Iterator[None]:
    """This process's file descriptors 1 and 2 write to `log` inside the block (children started
    there keep it); Python's own sys.stdout and sys.stderr are flushed at both ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def vllm_logger_to(log: IO) -> dict[logging.StreamHandler, IO]:
    """The handlers of vLLM's logger in this process that write to the console (its own holds
    sys.stdout) write to `log` from now on; others (a file, a test's capture) are left alone.
    Returns each one's former stream."""
    console = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    return {h: h.setStream(log) for h in logging.getLogger("vllm").handlers
            if isinstance(h, logging.StreamHandler) and id(h.stream) in console}
