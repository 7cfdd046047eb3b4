"""Memory, process and CPU limits for a run's whole process tree: a cgroup of its own.

    slot = Slots(find()).create() ─► per run: slot.prepare(limits), the run's first process joins
    it (join_files), slot.cpu_s() while it runs (runner.py kills it past cpu_time_s), slot.usage()
    (peak memory, OOM kills), slot.settle() (nothing the run left is charged to the next)

CPU (where the cpu and cpuacct controllers are, v1, or cpu on v2): a quota of `cpu_cores` cores
for the tree, and its CPU time summed over every process, so that forking children (each with
an RLIMIT_CPU of its own) buys no more than cpu_time_s. Without them, RLIMIT_CPU per process and
the wall clock remain.

The launcher itself stays outside (in the caller's cgroup), so that no run can make the kernel's
OOM killer pick it: each run's first process joins the slot before it does anything else. On v1
it writes its own thread id to the `tasks` files, not `cgroup.procs`: moving one thread of a
one-thread process is the same move, but it skips the kernel's global thread-group lock, whose
taking waits for an RCU grace period (measured here, runs 30 ms apart: +0.1 ms a run through
`tasks`, +4 ms through `cgroup.procs`). v2 has no such file outside threaded cgroups, so there
a run pays the lock.

One slot (a cgroup, or several on v1) per launcher, reused for all its runs (one at a time):
creating and removing a memory cgroup per run would leave offline memory cgroups behind for as
long as page cache is charged to them, and their ids are a limited kernel resource. A slot's
counters are reset at the start of each run (peak memory) or read as a difference (OOM kills).

Where: under this process's own cgroup, so that the limits that hold for the caller (a container's,
a job's) still hold for the runs: v1 needs the memory and pids controllers mounted (it is what
these machines have); v2 needs memory and pids enabled in this cgroup's subtree_control, which
this module tries to do and which fails when the cgroup also holds processes (the kernel's "no
internal processes" rule, e.g. a container's root), in which case there is no cgroup layer.
Slots are named asyncrl-sandbox-<pid>-<n>; Slot.remove() removes one, and create() first removes
those of processes that are gone (a worker killed with SIGKILL cannot clean up).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "asyncrl-sandbox-"
CPU_PERIOD_US = 100_000
_NAME = re.compile(rf"{PREFIX}(\d+)-\d+$")
_counter = itertools.count(1)  # slot names are unique in this process, whichever Slots made them


@dataclass(frozen=True)
class Hierarchy:
    """Where this process's cgroups are: version, and per controller the directory of its cgroup."""

    version: int
    dirs: dict[str, Path]  # controller (memory, pids; cpu, cpuacct where there) -> this process's cgroup directory


@dataclass
class Slot:
    version: int
    dirs: dict[str, Path]  # controller -> the slot's cgroup directory
    memory_mb: int = 1 << 40  # the limits now: a new cgroup has none
    max_tasks: int = 0
    cpu_cores: float = 0.0  # 0: no quota
    _oom_before: int = 0
    _cpu_before: float = 0.0
    _peak_fd: int | None = field(default=None, repr=False)

    @property
    def procs_files(self) -> list[bytes]:
        """The cgroup.procs files, which list the slot's processes (one per hierarchy)."""
        return sorted({bytes(d / "cgroup.procs") for d in self.dirs.values()})

    @property
    def join_files(self) -> list[bytes]:
        """The files a run's first process writes "0" into to join the slot with the thread it is
        (one per hierarchy; the module docstring says why `tasks` on v1)."""
        name = "tasks" if self.version == 1 else "cgroup.procs"
        return sorted({bytes(d / name) for d in self.dirs.values()})

    @property
    def has_cpu(self) -> bool:
        return "cpu" in self.dirs

    def prepare(self, memory_mb: int, max_tasks: int, cpu_cores: float = 0.0) -> None:
        """Set the limits for the next run (cpu_cores 0: no quota) and reset its counters."""
        if self.has_cpu and cpu_cores != self.cpu_cores:
            quota = int(cpu_cores * CPU_PERIOD_US) if cpu_cores > 0 else -1
            if self.version == 1:
                (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (self.dirs["cpu"] / "cpu.max").write_text(f"{quota if quota > 0 else 'max'} {CPU_PERIOD_US}")
            self.cpu_cores = cpu_cores
        if self.has_cpu:
            self._cpu_before = self._cpu_total()
        if self.version == 1:
            mem, pids = self.dirs["memory"], self.dirs["pids"]
            if memory_mb != self.memory_mb:
                limit = str(memory_mb << 20)
                # memsw (memory + swap) must stay >= the memory limit: order the writes by direction
                files = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
                for name in files if memory_mb < self.memory_mb else reversed(files):
                    if (mem / name).exists():
                        (mem / name).write_text(limit)
            (mem / "memory.max_usage_in_bytes").write_text("0")  # the peak, reset to the usage now
            if max_tasks != self.max_tasks:
                (pids / "pids.max").write_text(str(max_tasks))
        else:
            d = self.dirs["memory"]
            if memory_mb != self.memory_mb:
                (d / "memory.max").write_text(str(memory_mb << 20))
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
            if max_tasks != self.max_tasks:
                (d / "pids.max").write_text(str(max_tasks))
            self._reset_peak_v2(d)
        self.memory_mb, self.max_tasks = memory_mb, max_tasks
        self._oom_before = self._oom_kills()

    def cpu_s(self) -> float | None:
        """CPU seconds of every process of the slot since prepare() (None: no cpu controller)."""
        return self._cpu_total() - self._cpu_before if self.has_cpu else None

    def _cpu_total(self) -> float:
        if self.version == 1:
            return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        for line in (self.dirs["cpu"] / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        return 0.0

    def _reset_peak_v2(self, d: Path) -> None:
        # memory.peak is resettable since Linux 6.12, per open file: keep one fd to write and read
        if self._peak_fd is None and (d / "memory.peak").exists():
            self._peak_fd = os.open(d / "memory.peak", os.O_RDWR | os.O_CLOEXEC)
        if self._peak_fd is not None:
            try:
                os.pwrite(self._peak_fd, b"reset\n", 0)
            except OSError:  # an older kernel: the peak is the slot's lifetime peak
                pass

    def usage(self) -> tuple[float | None, int]:
        """(peak memory of the run in MiB or None if unknown, OOM kills during the run)."""
        if self.version == 1:
            peak = int((self.dirs["memory"] / "memory.max_usage_in_bytes").read_text())
        elif self._peak_fd is not None:
            peak = int(os.pread(self._peak_fd, 64, 0))
        else:
            peak = None
        return (None if peak is None else peak / (1 << 20)), self._oom_kills() - self._oom_before

    def held_mb(self) -> float:
        """Memory charged to the slot that reclaim cannot take back (all but file pages, which
        the kernel drops under pressure): what a run may have left behind it."""
        if self.version == 1:
            used = int((self.dirs["memory"] / "memory.usage_in_bytes").read_text())
            names = ("total_active_file", "total_inactive_file")
        else:
            used = int((self.dirs["memory"] / "memory.current").read_text())
            names = ("active_file", "inactive_file")
        stat = dict(line.split() for line in (self.dirs["memory"] / "memory.stat").read_text().splitlines())
        return max(0, used - sum(int(stat.get(n, 0)) for n in names)) / (1 << 20)

    def settle(self, held_mb: float, timeout_s: float) -> bool:
        """Whether what the last run left in the slot falls to held_mb within timeout_s. A run can
        park memory past its end in a cycle of Unix sockets that hold each other's descriptors
        (SCM_RIGHTS), which the kernel frees only when its Unix-socket garbage collector runs,
        0.1-2 s later; closing a Unix socket of our own starts it now (~0.1 s)."""
        if self.held_mb() <= held_mb:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            a, b = socket.socketpair()
            a.close(), b.close()
            time.sleep(0.005)
            if self.held_mb() <= held_mb:
                return True
            if time.monotonic() > deadline:
                return False

    def _oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.dirs["memory"] / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids(self) -> list[int]:
        return sorted({int(p) for d in self.dirs.values() for p in (d / "cgroup.procs").read_text().split()})

    def kill(self, timeout_s: float = 2.0) -> bool:
        """SIGKILL everything in the slot; True once it is empty."""
        deadline = time.monotonic() + timeout_s
        kill_file = self.dirs["memory"] / "cgroup.kill"
        while pids := self.pids():
            if self.version == 2 and kill_file.exists():
                kill_file.write_text("1")
            else:  # pids.max bounds how many can be forked between two reads
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def remove(self) -> None:
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        self.kill()
        for d in set(self.dirs.values()):
            _rmdir(d)


def find(proc_self: Path = Path("/proc/self")) -> Hierarchy | None:
    """This process's cgroups with memory and pids control, v1 or v2; None if there are none."""
    mounts = _cgroup_mounts(proc_self / "mountinfo")
    own = {}
    for line in (proc_self / "cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            own[c] = path.lstrip("/")
    v1 = {c: mounts[c] / own[c] for c in ("memory", "pids", "cpu", "cpuacct") if c in mounts and c in own}
    if "memory" in v1 and "pids" in v1:
        if not ("cpu" in v1 and "cpuacct" in v1):  # both or neither: the quota and the account
            v1.pop("cpu", None), v1.pop("cpuacct", None)
        return Hierarchy(1, v1)
    if "" in mounts and "" in own:
        d = mounts[""] / own[""]
        enabled = set((d / "cgroup.controllers").read_text().split())
        if {"memory", "pids"} <= enabled:
            return Hierarchy(2, {"memory": d, "pids": d, **({"cpu": d} if "cpu" in enabled else {})})
    return None


def _cgroup_mounts(mountinfo: Path) -> dict[str, Path]:
    """controller -> mount point (v1), "" -> the v2 mount point."""
    out: dict[str, Path] = {}
    for line in mountinfo.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, fstype_and_rest = left.split(), right.split()
        if len(fields) < 5 or len(fstype_and_rest) < 3:
            continue
        fstype, options, mount_point = fstype_and_rest[0], fstype_and_rest[2], Path(fields[4])
        if fstype == "cgroup2":
            out.setdefault("", mount_point)
        elif fstype == "cgroup":
            for opt in options.split(","):
                out.setdefault(opt, mount_point)
    return out


class Slots:
    """Creates this process's slots (one per launcher at a time, launcher.py) and removes them."""

    def __init__(self, hierarchy: Hierarchy):
        self.hierarchy = hierarchy
        self._swept_by = 0  # the pid that removed stale slots (a fork does it again for itself)
        self._lock = threading.Lock()

    def create(self) -> Slot:
        with self._lock:
            if self._swept_by != os.getpid():
                self._swept_by = os.getpid()
                remove_stale(self.hierarchy)
            name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        h = self.hierarchy
        dirs = {c: d / name for c, d in h.dirs.items()}
        if h.version == 2:
            _enable_v2_controllers(h.dirs["memory"])
        made = []
        try:
            for d in set(dirs.values()):
                d.mkdir()
                made.append(d)
        except OSError:
            for d in made:
                _rmdir(d)
            raise
        return Slot(h.version, dirs)


def _enable_v2_controllers(d: Path) -> None:
    wanted = {"memory", "pids"} | ({"cpu"} & set((d / "cgroup.controllers").read_text().split()))
    if not wanted <= set((d / "cgroup.subtree_control").read_text().split()):
        (d / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))


def remove_stale(hierarchy: Hierarchy) -> list[Path]:
    """Remove the slots of processes that no longer exist; returns what was removed."""
    removed = []
    for parent in set(hierarchy.dirs.values()):
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for d in entries:
            match = _NAME.match(d.name)
            if match and not _alive(int(match.group(1))):
                slot = Slot(hierarchy.version, {"memory": d, "pids": d})
                slot.kill()
                if _rmdir(d):
                    removed.append(d)
    return removed


def leftover_slots(hierarchy: Hierarchy) -> list[Path]:
    """Every sandbox slot under this process's cgroups (for tests: none once all is released)."""
    out = []
    for parent in set(hierarchy.dirs.values()):
        out += [d for d in parent.iterdir() if _NAME.match(d.name)]
    return sorted(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rmdir(d: Path) -> bool:
    for _ in range(100):  # EBUSY for a moment while the last killed task is released
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.005)
    return False
