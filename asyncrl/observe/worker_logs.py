"""Where the learner's and the rollout actors' own output goes: a file per process in the run's
logs/ directory, so the console shows asyncrl's progress and not vLLM's and Ray's start-up chatter
(`observe.worker_logs=console` forwards it to the console instead).

The orchestrator names the file in the process's environment (`log_env`); the process calls
`redirect_output` first thing, which points its stdout and stderr (file descriptors 1 and 2, so
C extensions and the engine processes vLLM spawns write there too) at that file.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

ENV = "ASYNCRL_LOG_FILE"


def log_env(run_dir: Path, name: str, worker_logs: str) -> dict[str, str]:
    """The environment entry that sends process `name`'s output to <run_dir>/logs/<name>.log."""
    if worker_logs != "file":
        return {}
    return {ENV: str(Path(run_dir).resolve() / "logs" / f"{name}.log")}


def redirect_output(path: str | None = None) -> str | None:
    """Send this process's stdout and stderr to `path`, by default the file in $ASYNCRL_LOG_FILE
    (appending; a process reused by the next run of a study is pointed at that run's file);
    returns the path, or None when there is none or it cannot be opened (output stays)."""
    path = path or os.environ.get(ENV)
    if not path:
        return None
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:  # e.g. the run directory is on another node's disk: keep Ray's own log
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # which node wrote what follows: on a cluster the processes of one run are on several
    print(f"--- {Path(path).stem}: pid {os.getpid()} on {socket.gethostname()} "
          f"({os.environ.get('RAY_NODE_IP_ADDRESS') or _node_ip()})", flush=True)
    return path


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "no Ray"
    except Exception:  # a log line must not fail the process it describes
        return "unknown address"
