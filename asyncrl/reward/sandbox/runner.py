"""run_sandboxed: start a program in the sandbox through this process's launcher, collect its
output under the limits, classify how it ended (the caller's side; launcher.py and spawn.py do
the rest)."""

from __future__ import annotations

import atexit
import functools
import itertools
import math
import os
import resource
import selectors
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.reward.sandbox import rootfs
from asyncrl.reward.sandbox.launcher import STOP_GRACE_S, Launcher, Launchers
from asyncrl.reward.sandbox.layers import Isolation, isolation

if TYPE_CHECKING:
    from asyncrl.config import SandboxConfig

SANDBOX_UID_BASE = 0x6000_0000  # far above login, system and systemd-dynamic uids
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGFPE, signal.SIGBUS, signal.SIGILL}
MEMORY_MARKERS = (b"MemoryError", b"std::bad_alloc", b"out of memory", b"Cannot allocate memory")
HELPER_TASKS = 2  # in a run's cgroup besides the program: its init, or two (bwrap's; a supervisor and its init)
TRUE = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"
_uid_counter = itertools.count()
_pools: dict[Isolation, Launchers] = {}
_active: set[Launcher] = set()
BROKEN = (-signal.SIGKILL, 0.0)  # the result of a run whose launcher broke
SETTLED_MB = 16  # memory a slot may still hold after a run (besides file cache) and be reused
SETTLE_S = 2.0  # how long a run's leftovers get to be freed before its slot is replaced
CPU_CHECK_S = 0.05  # how often a run's CPU time is read, where its cgroup counts it


@dataclass
class RunResult:
    status: str
    returncode: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    backend: str = ""
    """How the run was isolated: bwrap, namespaces or bare (see layers.py)."""
    uid: int | None = None
    """The run's own uid (None when not running as root)."""
    peak_memory_mb: float | None = None
    """The most memory the run's processes held together (None without a cgroup)."""


def run_sandboxed(argv: list[str], stdin: bytes, limits: SandboxConfig, workdir: Path,
                  persist: bool = False) -> RunResult:
    """Run argv with the run directory `workdir` (its files are copied in, or with persist=True it
    is bound read-write so that what the program writes stays, e.g. a compiler's output) under the
    limits; argv names files in the run directory relatively. Never raises for anything the
    program does."""
    return _run(argv, stdin, limits, Path(workdir), persist, isolation(limits.backend))


@dataclass(frozen=True)
class _ProbeLimits:  # the fields of SandboxConfig a run reads (config is not imported here)
    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_mb: int = 64
    max_processes: int = 4
    max_file_mb: int = 1
    max_output_kb: int = 64
    max_open_files: int = 64
    syscall_filter: bool = True
    cpu_cores: float = 1.0


def probe_run(candidate: Isolation, workdir: str) -> RunResult:
    try:
        return _run([TRUE], b"", _ProbeLimits(), Path(workdir), False, candidate)
    finally:
        release(candidate)


def kill_active() -> None:
    """Kill every run in progress (the reward pool calls this when it stops a worker; a worker
    killed outright takes its runs down anyway: its launchers see their sockets close)."""
    for launcher in list(_active):
        launcher.kill()


def release(iso: Isolation | None = None) -> None:
    """End this process's launchers (of one isolation, or all) and remove their cgroups."""
    for key, pool in list(_pools.items()):
        if iso is None or key == iso:
            pool.release()


atexit.register(release)


def _pool(iso: Isolation) -> Launchers:
    if iso not in _pools:
        config = {"backend": iso.backend, "userns": iso.userns, "net_flags": iso.net_flags, "bwrap": iso.bwrap,
                  "seccomp": iso.seccomp}  # the launcher builds the filter once
        _pools[iso] = Launchers(config, iso.slots)
    return _pools[iso]


def _next_uid() -> int:
    # The caller's pid is unique among live callers; the counter separates runs of one caller.
    return SANDBOX_UID_BASE + ((os.getpid() & 0x3F_FFFF) << 6) + next(_uid_counter) % 64


def _run(argv: list[str], stdin: bytes, limits: SandboxConfig, workdir: Path, persist: bool,
         iso: Isolation) -> RunResult:
    uid = _next_uid() if os.geteuid() == 0 else None
    start = time.monotonic()
    pool = _pool(iso)
    try:
        launcher, stdout_r, stderr_r = _start(pool, argv, stdin, limits, workdir, persist, iso, uid)
    except _StartError as e:
        return RunResult("sandbox_error", None, b"", e.why, time.monotonic() - start, iso.backend, uid)
    _active.add(launcher)
    try:
        stdout, stderr, reason, ended = _collect(launcher, stdout_r, stderr_r, start + limits.wall_time_s,
                                                 limits.max_output_kb << 10, limits.cpu_time_s)
        if ended is None:
            launcher.kill()
            ended = launcher.result(STOP_GRACE_S) or BROKEN
    finally:
        _active.discard(launcher)
    peak, oom_kills = launcher.slot.usage() if launcher.slot is not None else (None, 0)
    if ended is BROKEN:  # the launcher did not answer: replace it (its run dies with it)
        pool.discard(launcher)
        if launcher.error:  # it said why: a fault of the sandbox, not of the program
            return RunResult("sandbox_error", None, stdout, launcher.error, time.monotonic() - start, iso.backend, uid)
    elif launcher.slot is not None and not launcher.slot.settle(SETTLED_MB, SETTLE_S):
        pool.renew_slot(launcher)  # what the run left would be charged to the next: a fresh slot instead
    else:
        pool.put_back(launcher)
    returncode, cpu_s = ended
    if reason == "timeout" and oom_kills:
        reason = None  # reclaim at the memory limit burns the tree's CPU: the limit hit first is memory
    status = reason or ("memory" if oom_kills else _classify(returncode, cpu_s, stderr, limits))
    return RunResult(status, returncode, stdout, stderr, time.monotonic() - start, iso.backend, uid, peak)


class _StartError(Exception):
    def __init__(self, why: bytes):
        super().__init__(why)
        self.why = why


def _start(pool: Launchers, argv, stdin, limits, workdir, persist, iso, uid) -> tuple[Launcher, int, int]:
    """A launcher running the program, and the read ends of its stdout and stderr; raises
    _StartError when the host could not set the run up (no cgroup, no process left, a launcher
    that died: it is replaced)."""
    launcher, fds = None, {}
    try:
        launcher = pool.acquire()
        if launcher.slot is not None:
            launcher.slot.prepare(limits.memory_mb, limits.max_processes + HELPER_TASKS, limits.cpu_cores)
        if uid is not None and (persist or iso.backend == "bare"):
            for path in [workdir, *workdir.iterdir()]:  # the program writes here as its own uid
                os.chown(path, uid, uid, follow_symlinks=False)
            os.chmod(workdir, 0o700)
        fds["out_r"], fds["out_w"] = os.pipe()
        fds["err_r"], fds["err_w"] = os.pipe()
        fds["stdin"] = os.memfd_create("stdin", os.MFD_CLOEXEC)  # a file: no deadlock on big inputs
        _write_all(fds["stdin"], stdin)
        os.lseek(fds["stdin"], 0, os.SEEK_SET)
        request = _request(argv, limits, workdir, persist, iso, uid, launcher)
        why = launcher.start(request, [fds["stdin"], fds["out_w"], fds["err_w"]])
    except OSError as e:
        why = repr(e).encode()
    for name in ("out_w", "err_w", "stdin") if why is None else list(fds):
        os.close(fds.pop(name))
    if why is None:
        return launcher, fds["out_r"], fds["err_r"]
    if launcher is not None:
        if launcher.proc.poll() is None:
            pool.put_back(launcher)
        else:
            pool.discard(launcher)
    raise _StartError(why)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _request(argv, limits, workdir, persist, iso, uid, launcher) -> dict:
    rlimits = [(resource.RLIMIT_CPU, limits.cpu_time_s, limits.cpu_time_s + 1),  # SIGXCPU, then SIGKILL
               (resource.RLIMIT_AS, limits.memory_mb << 20, limits.memory_mb << 20),
               (resource.RLIMIT_FSIZE, limits.max_file_mb << 20, limits.max_file_mb << 20),
               (resource.RLIMIT_NOFILE, limits.max_open_files, limits.max_open_files),
               # 1, not 0: where core_pattern pipes to a helper the kernel starts it whatever the
               # limit, except at exactly 1; a file core needs a page at least, so 1 writes none
               (resource.RLIMIT_CORE, 1, 1)]
    if uid is not None:  # counted per uid; the run's uid is its own, also its init's or bwrap's two
        nproc = limits.max_processes + {"namespaces": 1, "bwrap": 2}.get(iso.backend, 0)
        rlimits.append((resource.RLIMIT_NPROC, nproc, nproc))
    home, tmp = (str(workdir), str(workdir)) if iso.backend == "bare" else (rootfs.RUN_DIR, "/tmp")
    return {"argv": list(argv), "uid": uid, "workdir": bytes(workdir), "persist": persist,
            "steps": rootfs.layout((argv[0],)) if iso.backend != "bare" else (),
            "tmpfs_mb": limits.memory_mb, "rlimits": tuple(rlimits), "wall_s": math.ceil(limits.wall_time_s),
            "cap_last": _cap_last(), "seccomp": iso.seccomp and limits.syscall_filter,
            "cgroup_procs": launcher.slot.procs_files if launcher.slot is not None else [],
            "cgroup_join": launcher.slot.join_files if launcher.slot is not None else [],
            "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": tmp,
                    "PYTHONDONTWRITEBYTECODE": "1"}}


@functools.cache
def _cap_last() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 40


def _collect(launcher: Launcher, stdout_r: int, stderr_r: int, deadline: float,
             cap: int, cpu_s: float = math.inf) -> tuple[bytes, bytes, str | None, tuple | None]:
    """Read stdout and stderr until both close and the run has ended, the deadline passes or the
    run's whole tree has used cpu_s of CPU ("timeout", the latter checked every CPU_CHECK_S where
    the slot counts CPU), or one exceeds cap ("output_limit"); nothing beyond cap is kept, so a
    program printing gigabytes costs cap. Returns the outputs, the reason, and the launcher's
    result (None if the run has not ended, BROKEN if the launcher did not answer)."""
    bufs = {stdout_r: bytearray(), stderr_r: bytearray()}
    reason, ended = None, None
    slot = launcher.slot if launcher.slot is not None and launcher.slot.has_cpu else None
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(launcher.fileno(), selectors.EVENT_READ)
        while reason is None and (len(sel.get_map()) > 1 or ended is None):
            now = time.monotonic()
            if now >= deadline or (slot is not None and ended is None and slot.cpu_s() > cpu_s):
                reason = "timeout"
                break
            wait = deadline - now if slot is None else min(deadline - now, CPU_CHECK_S)
            for key, _ in sel.select(timeout=wait):
                if key.fd == launcher.fileno():
                    sel.unregister(key.fd)
                    ended = launcher.result(0) or BROKEN
                    deadline = min(deadline, time.monotonic() + 1.0)  # leftovers die with the run
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                buf += chunk[: cap + 1 - len(buf)]
                if len(buf) > cap:
                    del buf[cap:]
                    reason = "output_limit"
                    break
    os.close(stdout_r)
    os.close(stderr_r)
    return bytes(bufs[stdout_r]), bytes(bufs[stderr_r]), reason, ended


def _classify(returncode: int, cpu_s: float, stderr: bytes, limits: SandboxConfig) -> str:
    if returncode == 0:
        return "ok"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and cpu_s >= limits.cpu_time_s - 0.05:
        return "timeout"  # SIGXCPU at the soft CPU limit, SIGKILL at the hard one
    if any(marker in stderr for marker in MEMORY_MARKERS):
        return "memory"
    if returncode > 0 or -returncode in CRASH_SIGNALS:
        return "crashed"
    return "killed"
