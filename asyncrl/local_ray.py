"""The local Ray cluster a driver starts (`ray.init(address="local")`) ends with that driver,
however it ends.

Ray's daemons die with the driver that started them, all but two. The raylet's agents
(`ray::DashboardAgent`, `ray::RuntimeEnvAgent`), finding the raylet gone without having logged a
SIGTERM, first report its death to the GCS, which died with it too, and wait for the answer with a
timeout Ray hard-codes at 60 s; SIGTERM does not end them while they wait. So:

- a driver that exits at once (a second Ctrl-C) first sends its raylet SIGTERM (`end_local_ray`):
  a raylet that logged it lets its agents exit at once;
- a driver killed outright (SIGKILL, the OOM killer) runs nothing more, so a reaper process,
  started beside it once its cluster is up (`start_reaper`), notes the raylet's children every
  SNAPSHOT_S while it waits on a pipe that only the driver holds open. At end of file (the driver
  gone, whatever the cause) it sends the raylet SIGTERM, and SIGKILL after REAP_GRACE_S to the
  children it noted that are still there. (Not by their environment: the agents retitle
  themselves over it. Not by process group: the driver's may hold its user's other processes.)

The reaper imports nothing but the standard library, so it starts in a fraction of a second.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

# Without these the run can do nothing more (the dashboard's processes may exit on their own).
ESSENTIAL_DAEMONS = ("gcs_server", "raylet")
REAP_GRACE_S = 2.0  # for what a SIGTERM'd raylet lets exit on its own
SNAPSHOT_S = 1.0
_reaper: list = []  # the pipe's write end and the reaper's Popen, held for the life of the driver


def _own_node():
    """Ray's record of the cluster this driver started; None for a cluster joined by address, no
    cluster, or a Ray without this internal."""
    try:
        from ray._private import worker

        node = worker._global_node
        return node if node is not None and node.head else None
    except Exception:
        return None


def raylet_pids() -> list[int]:
    """The pids of the raylets of the cluster this driver started; [] for any other."""
    node = _own_node()
    return [info.process.pid for info in node.all_processes.get("raylet", [])] if node is not None else []


def end_local_ray(wait_s: float = 0.5) -> None:
    """Before this driver exits at once: SIGTERM to the raylet of the local cluster it started, and
    wait_s for it to log that it got it (see the module docstring)."""
    pids = raylet_pids()
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    if pids:
        time.sleep(wait_s)


def local_ray_exited() -> list[str]:
    """The kinds of Ray daemon (gcs_server, raylet...) of the local cluster this driver started that
    have exited; [] on a cluster joined by address, or when Ray's node object cannot tell."""
    node = _own_node()
    try:
        return [] if node is None else sorted({kind for kind, _ in node.dead_processes()} & set(ESSENTIAL_DAEMONS))
    except Exception:  # a Ray without this internal: no early exit, Ray's own timeout applies
        return []


def start_reaper() -> int | None:
    """Once this driver's own cluster is up: the reaper's pid (None on a cluster joined by address).
    Its own session, so a signal to the driver's process group leaves it to do its work."""
    pids = raylet_pids()
    if not pids:
        return None
    read, write = os.pipe()  # both ends close-on-exec: no other child of the driver holds `write`
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.local_ray", *map(str, pids)], stdin=read,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    os.close(read)
    _reaper.extend([write, proc])
    return proc.pid


def reap(noted: dict[int, bytes], raylets: dict[int, bytes], grace_s: float = REAP_GRACE_S) -> list[int]:
    """What the reaper does once the driver is gone: SIGTERM to the raylets, then SIGKILL to those
    of the processes `noted` that are still there after grace_s; their pids. Both are
    {pid: start time}: a pid given since to another process is not the same process."""
    for pid in _same(raylets):
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := _same(noted)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    return left


def _same(processes: dict[int, bytes]) -> list[int]:
    return [pid for pid, started in processes.items() if _stat(pid)[1] == started]


def children(parents: dict[int, bytes]) -> dict[int, bytes]:
    """{pid: start time} of the live processes whose parent is one of `parents` (pids as keys)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdecimal() and (st := _stat(int(entry)))[0] in parents:
            found[int(entry)] = st[1]
    return found


def _stat(pid: int) -> tuple[int, bytes]:
    """(parent pid, start time) of a live process; (0, b"") for one gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return 0, b""
    return (0, b"") if fields[0] == b"Z" else (int(fields[1]), fields[19])


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    """The reaper: stdin is the read end of the driver's pipe; argv the raylets' pids."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the driver's terminal is the driver's
    raylets, noted = {int(a): _stat(int(a))[1] for a in argv}, {}
    while True:
        noted = children(raylets) or noted  # the raylet's children while it had any
        if select.select([0], [], [], SNAPSHOT_S)[0] and not os.read(0, 1):  # nothing is written: b"" is the end
            break
    reap(noted, raylets)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
