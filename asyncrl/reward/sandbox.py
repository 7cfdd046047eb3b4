"""Run one untrusted program (a model's solution) in a subprocess sandbox; the code verifier's executor.

    run_sandboxed(argv, stdin, limits, workdir) -> RunResult(status, returncode, stdout, stderr, wall_s)

status: ok, crashed (nonzero exit or SIGSEGV/SIGABRT/SIGFPE/SIGBUS/SIGILL), timeout (wall limit,
or the CPU limit's SIGXCPU/SIGKILL), memory (MemoryError / std::bad_alloc / out of memory on
stderr), output_limit (stdout or stderr over max_output_kb), killed (any other signal),
sandbox_error (the sandbox itself could not start the program).

What is protected, and how (full protection needs root, which the reward workers have):
- The host's processes and files: the program runs under a uid of its own, different for every
  run and used by nothing else (SANDBOX_UID_BASE + caller pid + counter; not the shared `nobody`,
  which would let concurrent runs signal each other and share one RLIMIT_NPROC count). It cannot
  signal the trainer, read /proc/<pid>/environ of other processes, or write where that uid may
  not: it may write its workdir (chowned to it) and world-writable places such as /tmp.
- Secrets: a minimal environment (PATH, LANG, HOME and TMPDIR = workdir, PYTHONDONTWRITEBYTECODE);
  inherited file descriptors are closed.
- Network: a fresh network namespace whose only device is a loopback that is down, so no
  connection anywhere, the host's 127.0.0.1 included.
- Resources: rlimits on CPU time, address space, processes (counted per uid, so per run), file
  size, no core dumps; the wall-clock limit and the output cap are enforced here by the parent.
- Leftovers: at the end the process group is killed, then every process of the run's uid
  (`kill -9 -1` run as that uid), which also reaches children that left the group with setsid();
  the caller becomes a child subreaper so it can reap those orphans itself (a container's PID 1
  often does not); files that uid left at the top of /tmp, /var/tmp and /dev/shm are removed.

Not protected: there is no seccomp filter, mount namespace or chroot, so the program can read
every world-readable file and make any system call an unprivileged user can (kernel bugs are out
of scope); no disk quota beyond max_file_mb per file. Without root the sandbox degrades: no uid
change (the program could signal the caller and read its /proc entries), no RLIMIT_NPROC (it would
count all the caller's processes), no per-uid sweep (only the process group is killed), and the
network is isolated only if the kernel lets unprivileged users create user namespaces;
`RunResult.network_isolated` says whether it was. A caller killed with SIGKILL mid-run cannot
clean up: the run's processes live on (a sleeping one indefinitely), which is why the reward pool
sends SIGTERM first, on which its workers call kill_active().

The caller owns workdir and removes it; the sandbox uid must be able to traverse its parents.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import SandboxConfig

SANDBOX_UID_BASE = 0x6000_0000  # far above login, system and systemd-dynamic uids
CLONE_NEWNET, CLONE_NEWUSER = 0x4000_0000, 0x1000_0000
PR_SET_CHILD_SUBREAPER = 36
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGFPE, signal.SIGBUS, signal.SIGILL}
MEMORY_MARKERS = (b"MemoryError", b"std::bad_alloc", b"out of memory", b"Cannot allocate memory")
SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
KILL = shutil.which("kill", path="/usr/bin:/bin") or "/bin/kill"
TRUE = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"
_uid_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls it
_subreaper_pid = 0  # the process that made itself a subreaper (forked children are not)
_active: dict[int, int | None] = {}  # pid -> uid of the runs in progress, for kill_active()


@dataclass
class RunResult:
    status: str
    returncode: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    network_isolated: bool = False
    uid: int | None = None
    """The run's own uid (None when not running as root)."""


def _enter_sandbox(limits: SandboxConfig, uid: int | None, net: str | None) -> None:
    """preexec_fn: runs in the child between fork and exec, after setsid()."""
    if net == "net" and _libc.unshare(CLONE_NEWNET) != 0:  # needs root: before the uid change
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
    cpu = limits.cpu_time_s
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU first, SIGKILL a second later
    memory = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes,) * 2)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # as root this sets real, effective and saved uid: no way back
    if net == "user+net" and _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:  # unprivileged variant
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWNET)")


@functools.cache
def network_mode() -> str | None:
    """How this process can isolate the network: "net" (root), "user+net" (unprivileged user
    namespaces) or None; probed once with a real run of `true`."""
    from asyncrl.config import SandboxConfig

    uid = _next_uid() if os.geteuid() == 0 else None
    for mode in ["net", "user+net"] if uid is not None else ["user+net"]:
        enter = functools.partial(_enter_sandbox, SandboxConfig(), uid, mode)
        try:
            if subprocess.run([TRUE], preexec_fn=enter, env={}, cwd="/", timeout=10).returncode == 0:
                return mode
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def _next_uid() -> int:
    # The caller's pid is unique among live callers; the counter separates runs of one caller.
    return SANDBOX_UID_BASE + ((os.getpid() & 0x3F_FFFF) << 6) + next(_uid_counter) % 64


def sandbox_env(workdir: Path) -> dict[str, str]:
    home = str(workdir)
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home,
            "PYTHONDONTWRITEBYTECODE": "1"}


def processes_of(uid: int, zombies: bool = False) -> list[tuple[int, int]]:
    """(pid, parent pid) of the processes whose real uid is `uid`; zombies only when asked."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue  # exited while we looked
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            if zombies or not fields.get("State", "").strip().startswith("Z"):
                found.append((int(name), int(fields.get("PPid", "0"))))
    return found


def _become_subreaper() -> None:
    # Orphans of a sandbox are reparented to this process instead of PID 1, so _reap_orphans can
    # reap them: a container's PID 1 often never reaps, and zombies would keep counting against
    # the RLIMIT_NPROC of a uid that a later run reuses.
    global _subreaper_pid
    if _subreaper_pid != os.getpid():
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _subreaper_pid = os.getpid()


def _reap_orphans(uid: int) -> None:
    for pid, ppid in processes_of(uid, zombies=True):
        if ppid == os.getpid():
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def run_sandboxed(argv: list[str], stdin: bytes, limits: SandboxConfig, workdir: Path) -> RunResult:
    """Run argv in workdir under the limits (see the module docstring); never raises for
    anything the program does."""
    uid = _next_uid() if os.geteuid() == 0 else None
    net = network_mode()
    start = time.monotonic()
    try:
        if uid is not None:
            _become_subreaper()
            for path in [workdir, *workdir.iterdir()]:
                os.chown(path, uid, uid, follow_symlinks=False)
            os.chmod(workdir, 0o700)
        with tempfile.TemporaryFile() as stdin_file:  # a file, not a pipe: no deadlock on big inputs
            stdin_file.write(stdin)
            stdin_file.seek(0)
            proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=workdir, env=sandbox_env(workdir),
                                    start_new_session=True,
                                    preexec_fn=functools.partial(_enter_sandbox, limits, uid, net))
    except (OSError, subprocess.SubprocessError) as e:
        wall = time.monotonic() - start
        return RunResult("sandbox_error", None, b"", repr(e).encode(), wall, net is not None, uid)
    _active[proc.pid] = uid
    try:
        deadline = start + limits.wall_time_s
        stdout, stderr, reason = _collect(proc, deadline, limits.max_output_kb << 10, uid)
        if reason is None and not _wait_exit(proc.pid, deadline):
            reason = "timeout"
    finally:
        _kill_all(proc.pid, uid)
        waitstatus, rusage = os.wait4(proc.pid, 0)[1:]
        proc.returncode = os.waitstatus_to_exitcode(waitstatus)  # so Popen does not reap it again
        proc.stdout.close()
        proc.stderr.close()
        _active.pop(proc.pid, None)
        if uid is not None:
            _reap_orphans(uid)
            _remove_leftovers(uid, keep=workdir)
    wall = time.monotonic() - start
    status = reason or _classify(proc.returncode, rusage.ru_utime + rusage.ru_stime, stderr, limits)
    return RunResult(status, proc.returncode, stdout, stderr, wall, net is not None, uid)


def kill_active() -> None:
    """Kill every run in progress (the reward pool calls this when it stops a worker)."""
    for pid, uid in list(_active.items()):
        _kill_all(pid, uid)


def _collect(proc: subprocess.Popen, deadline: float, cap: int,
             uid: int | None) -> tuple[bytes, bytes, str | None]:
    """Read stdout and stderr until both close, the deadline passes ("timeout") or one exceeds
    cap ("output_limit"); nothing beyond cap is kept, so a program printing gigabytes costs cap."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    reason, exited_at = None, None
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and reason is None:
            now = time.monotonic()
            if now >= deadline:
                reason = "timeout"
                break
            if exited_at is None and _has_exited(proc.pid):
                # Whatever still holds the pipes is a leftover: kill it so the pipes close.
                exited_at = now
                _kill_all(proc.pid, uid)
            elif exited_at is not None and now - exited_at > 1.0:
                break  # without root, a setsid() child can keep the pipes open: stop reading
            for key, _ in sel.select(timeout=min(deadline - now, 0.05)):
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
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), reason


def _has_exited(pid: int) -> bool:
    # WNOWAIT leaves the zombie in place: its pid, and so its process group id, cannot be reused
    # before _kill_all has signalled the group.
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _wait_exit(pid: int, deadline: float) -> bool:
    """Whether the program exited before the deadline (it may close its pipes and keep running)."""
    while not _has_exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _kill_all(pid: int, uid: int | None) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # start_new_session: the group id is the program's pid
    except (ProcessLookupError, PermissionError):
        pass
    if uid is None:
        return
    for attempt in range(100):
        if not processes_of(uid):
            return
        # kill(-1) as the run's uid reaches exactly the processes of that uid, setsid() or not.
        subprocess.run([KILL, "-9", "--", "-1"], user=uid, group=uid, extra_groups=[], env={},
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.001 * attempt)


def _remove_leftovers(uid: int, keep: Path) -> None:
    keep_id = (keep.stat().st_dev, keep.stat().st_ino)  # the caller's workdir may sit in /tmp
    for top in SHARED_TMP_DIRS:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_uid != uid or (st.st_dev, st.st_ino) == keep_id:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass  # gone already


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
