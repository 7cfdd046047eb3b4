"""One live run per run directory, and no run started over another's files by accident.

Two runs given the same name would otherwise share `runs/<name>/`: interleaved metrics rows, two
`start` events, one overwriting the other's checkpoints. So a run holds an exclusive `flock` on
`<run dir>/run.lock` from before Ray starts until it shuts down; the kernel drops it when the
process dies, however it dies, so a killed run never leaves a stale lock. The file says who holds
it (pid, host, start time) for the error a second run prints.

A directory that already holds a run (events, metric rows or a checkpoint) is entered only to
continue it: with `resume=` (auto or a checkpoint path); else the run exits 2 naming the directory
and the ways on (resume=auto, another name, or removing the directory).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.orchestrator import checkpoint

LOCK_FILE = "run.lock"


class RunLock:
    """The held lock of one run directory; `release` (or process exit) lets the next run in."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self._fd = run_dir, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def claim_run_dir(run_dir: Path, resume: str | None) -> RunLock:
    """The run directory's lock, or ConfigError when a live run holds it or (without `resume`) a
    finished or stopped run left its files there."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace")
        os.close(fd)
        raise ConfigError(f"run directory {run_dir} is in use by a live run ({_describe(holder)}); give this "
                          "run another name (name=...) or stop that one first") from None
    left = None if resume is not None else previous_run(run_dir)
    if left:
        os.close(fd)
        raise ConfigError(f"run directory {run_dir} already holds a run ({left}); continue it with resume=auto, "
                          f"start another with name=<new name>, or remove {run_dir} to start over")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
    return RunLock(run_dir, fd)


def previous_run(run_dir: Path) -> str | None:
    """What an earlier run left in `run_dir` (None: nothing a new run would overwrite or mix with).
    A run that never got past its start (stopped or failed while its engines loaded) left only the
    `end` event saying so: the same command starts again there, as it would had Ray not started."""
    rows = _lines(run_dir / "metrics.jsonl")
    ckpts = checkpoint.list_complete(checkpoint.checkpoints_dir(run_dir))
    if not (rows or ckpts or _started(run_dir / "events.jsonl")):
        return None
    parts = [f"{rows} metric rows"] + ([f"newest checkpoint {ckpts[-1].name}"] if ckpts else [])
    if (run_dir / "summary.json").is_file():
        parts.append("finished")
    return ", ".join(parts)


def _started(events: Path) -> bool:
    """Whether a run began here: a `start` or `resume` event (written once the run's parts are up)."""
    try:
        with open(events, encoding="utf-8") as f:
            return any(_event(line) in ("start", "resume") for line in f if line.strip())
    except FileNotFoundError:
        return False


def _event(line: str) -> str | None:
    try:
        return json.loads(line).get("event")
    except (ValueError, AttributeError):  # a line cut short by a killed run: not a start
        return None


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):  # a holder between its lock and its first write
        return "starting"
