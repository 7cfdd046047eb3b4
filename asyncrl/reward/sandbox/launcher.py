"""The launcher: a small process of its own that starts and ends the runs of one caller, one run
at a time.

    caller (a reward worker) ──socket──► launcher ──fork──► init (pid 1) ──fork──► program

Why not fork from the caller: a reward worker holds sympy and math-verify (~80 MB), and forking
it cost 5 ms here, twice per run (init, program), where a bare subprocess.run uses vfork (0.5 ms).
The launcher is a fresh `python -I -S` holding only this package (~13 MB). It also keeps, for all
its runs:
- its cgroup: it lives in its slot (cgroups.py), so its children are born there; moving each run
  into a v1 cgroup instead waits for an RCU grace period (~14 ms every other run here);
- as root, its network and uts namespaces, created once (a fresh network namespace per run cost
  ~2-3 ms, partly in the kernel's asynchronous clean-up). A run cannot leave anything in them
  for the next: it has no capability to change them, and its sockets die with its processes;
- as root, a private mount namespace with the read-only part of the root built once per layout
  (rootfs.build_template); each run gets its own mount, ipc and pid namespaces on top.

Protocol (SOCK_SEQPACKET, pickled tuples; the run's stdin, stdout and stderr travel as fds):
    caller: ("run", request) [stdin, stdout, stderr]   launcher: ("started",) or ("error", why)
    caller: ("kill",)                                  launcher: ("exited", returncode, cpu_s)
The launcher answers "exited" after the run ended by itself or was killed; EOF on the socket (the
caller exited or died) kills the run and ends the launcher.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from asyncrl.reward.sandbox import fallback, rootfs, spawn
from asyncrl.reward.sandbox.cleanup import remove_tree

STOP_GRACE_S = 5.0  # a killed run that has not ended by then: SIGKILL its whole process group
ROOT_DIR = Path(__file__).resolve().parents[3]  # the directory holding the asyncrl package
# The package's place and the config come over the socket: a run's init is a fork of the launcher,
# and its command line is readable in the run's /proc.
BOOT = ("import os, sys; fd = int(sys.argv[1]); sys.path.insert(0, os.read(fd, 4096).decode()); "
        "from asyncrl.reward.sandbox.launcher import serve; serve(fd)")
MAX_MESSAGE = 1 << 20


class Launcher:
    """The caller's handle on one launcher process (see the module docstring)."""

    def __init__(self, config: dict, slot=None):
        """config: backend, userns, net_flags, bwrap (layers.Isolation); slot: the cgroup it
        lives in, or None."""
        self.slot = slot
        self.staging = ""  # the templates' mount point (an empty directory on the host)
        if config["backend"] == "namespaces" and not config["userns"]:
            self.staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", BOOT, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        theirs.close()
        ours.send(str(ROOT_DIR).encode())
        ours.send(json.dumps({**config, "staging": self.staging}).encode())
        if self._recv(60) != ("ready",):  # what it allocated starting up is not charged to the slot
            self.close()
            raise OSError("the sandbox launcher did not start")
        if slot is not None:
            for procs in slot.procs_files:  # before its first run: every run is born in the slot
                with open(procs, "w") as f:
                    f.write(str(self.proc.pid))

    def start(self, request: dict, fds: list[int]) -> bytes | None:
        """Start a run; None once it runs, else why it could not start."""
        socket.send_fds(self.sock, [pickle.dumps(("run", request))], fds)
        reply = self._recv(None)
        if reply is None:
            return b"the launcher died"
        return None if reply[0] == "started" else reply[1]

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(pickle.dumps(("kill",)))

    def result(self, timeout_s: float | None) -> tuple[int, float] | None:
        """(the program's return code, the run's CPU seconds), or None: the launcher broke."""
        reply = self._recv(timeout_s)
        return None if reply is None or reply[0] != "exited" else (reply[1], reply[2])

    def fileno(self) -> int:
        return self.sock.fileno()

    def _recv(self, timeout_s: float | None):
        if not select.select([self.sock], [], [], timeout_s)[0]:
            return None
        try:
            data = self.sock.recv(MAX_MESSAGE)
        except OSError:
            return None
        return pickle.loads(data) if data else None

    def close(self) -> None:
        """End the launcher (its run, if any, dies with it) and remove its staging directory."""
        self.sock.close()
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.staging:
            remove_tree(self.staging)


STAGING_PREFIX = "asyncrl-sandbox-root-"


class Launchers:
    """This process's launchers: one per run in progress, kept for the next runs, each with its
    own cgroup slot when there are cgroups."""

    def __init__(self, config: dict, slots=None):
        self.config, self.slots = config, slots
        self._free: list[Launcher] = []
        self._all: list[Launcher] = []
        self._lock = threading.Lock()
        self._owner = 0  # the pid these launchers belong to (a fork starts its own)

    def acquire(self) -> Launcher:
        with self._lock:
            if self._owner != os.getpid():  # new, or inherited through fork: the parent's
                for launcher in self._all:
                    launcher.sock.close()
                self._free, self._all, self._owner = [], [], os.getpid()
                remove_stale_staging(tempfile.gettempdir())
            if self._free:
                return self._free.pop()
        slot = self.slots.create() if self.slots is not None else None
        try:
            launcher = Launcher(self.config, slot)
        except BaseException:
            if slot is not None:
                slot.remove()
            raise
        with self._lock:
            self._all.append(launcher)
        return launcher

    def put_back(self, launcher: Launcher) -> None:
        with self._lock:
            if launcher in self._all:
                self._free.append(launcher)

    def discard(self, launcher: Launcher) -> None:
        """End a launcher that broke (it did not answer in time)."""
        with self._lock:
            if launcher in self._all:
                self._all.remove(launcher)
        _end(launcher)

    def release(self) -> None:
        """End all of this process's launchers and remove their slots."""
        with self._lock:
            launchers = self._all if self._owner == os.getpid() else []
            self._free, self._all = [], []
        for launcher in launchers:
            _end(launcher)


def _end(launcher: Launcher) -> None:
    launcher.close()
    if launcher.slot is not None:
        launcher.slot.remove()


def remove_stale_staging(tmp: str) -> None:
    """Staging directories of callers that are gone (one killed with SIGKILL cannot clean up)."""
    for entry in os.scandir(tmp):
        if entry.name.startswith(STAGING_PREFIX):
            pid = entry.name[len(STAGING_PREFIX):].split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(OSError):
                    remove_tree(entry.path)


# -- the launcher process ---------------------------------------------------------------------------

def serve(sock_fd: int) -> None:
    """The launcher's main loop (started by Launcher with `python -I -S -c BOOT`)."""
    sock = socket.socket(fileno=sock_fd)
    config = json.loads(sock.recv(MAX_MESSAGE))
    sock.set_inheritable(False)  # no run may inherit it
    server = _Server(sock, config)
    sock.send(pickle.dumps(("ready",)))
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
        except OSError:
            return
        if not msg:
            return  # the caller is gone
        request = pickle.loads(msg)
        if request[0] == "run" and server.run(request[1], fds):
            return


class _Server:
    def __init__(self, sock: socket.socket, config: dict):
        self.sock, self.backend, self.userns = sock, config["backend"], config["userns"]
        self.net_flags, self.bwrap = config["net_flags"], config["bwrap"]
        self.staging = config["staging"].encode()
        self.templates: dict[tuple, bytes] = {}
        if self.backend == "namespaces" and not self.userns:
            spawn._unshare(spawn.CLONE_NEWNS | spawn.CLONE_NEWNET | spawn.CLONE_NEWUTS)
            rootfs.mount(None, b"/", None, rootfs.MS_REC | rootfs.MS_PRIVATE)  # nothing leaks to the host
            rootfs.mount(b"tmpfs", self.staging, b"tmpfs", rootfs.MS_NOSUID | rootfs.MS_NODEV, b"size=1m,mode=0755")
            rootfs._libc.sethostname(b"sandbox", 7)
        elif self.backend == "bare" and self.net_flags & spawn.CLONE_NEWUSER:
            spawn.enter_user_namespace(spawn.CLONE_NEWNET)
        elif self.backend == "bare" and self.net_flags:
            spawn._unshare(self.net_flags)
        if self.backend in ("bare", "bwrap"):
            fallback.become_subreaper()  # every orphan of a run is ours to reap (we have no others)

    def _template(self, steps: tuple) -> bytes:
        if steps not in self.templates:
            root = self.staging + b"/%d" % len(self.templates)
            os.mkdir(root)
            rootfs.build_template(root, steps)
            self.templates[steps] = root
        return self.templates[steps]

    def run(self, request: dict, fds: list[int]) -> bool:
        """One run, start to end; True when the caller is gone."""
        pipes = {}
        for name in ("status", "error", "control"):
            pipes[f"{name}_r"], pipes[f"{name}_w"] = os.pipe()
        try:
            proc = self._start(request, fds, pipes)
        except (OSError, subprocess.SubprocessError) as e:
            why = _read_nonblocking(pipes["error_r"]) or repr(e).encode()
            self.sock.send(pickle.dumps(("error", why)))
            return False
        finally:
            for fd in [*fds, *(pipes.pop(k) for k in ("status_w", "error_r", "error_w", "control_r"))]:
                os.close(fd)
        self.sock.send(pickle.dumps(("started",)))
        gone = self._wait(proc, pipes, request)
        waitstatus, rusage = os.wait4(proc.pid, 0)[1:]
        proc.returncode = os.waitstatus_to_exitcode(waitstatus)  # so Popen does not reap it again
        returncode = self._program_status(waitstatus, pipes)
        self._clean_up(request)
        for fd in pipes.values():
            os.close(fd)
        if not gone:
            with contextlib.suppress(OSError):
                self.sock.send(pickle.dumps(("exited", returncode, rusage.ru_utime + rusage.ru_stime)))
        return gone

    def _start(self, request: dict, fds: list[int], pipes: dict[str, int]) -> subprocess.Popen:
        root = request["workdir"]
        if self.backend == "namespaces" and not self.userns:
            root = self._template(request["steps"])
        plan = spawn.Plan(
            backend=self.backend, userns=self.userns, uid=request["uid"], workdir=request["workdir"],
            root=root, persist=request["persist"], steps=request["steps"], tmpfs_mb=request["tmpfs_mb"],
            rlimits=request["rlimits"], control_fd=pipes["control_r"], status_fd=pipes["status_w"],
            error_fd=pipes["error_w"], wall_s=request["wall_s"], argv=tuple(request["argv"]),
            env=tuple(request["env"].items()), bwrap=self.bwrap, cap_last=request["cap_last"])
        with _children_in_new_pid_namespace(self.backend == "namespaces" and not self.userns):
            return subprocess.Popen(request["argv"], stdin=fds[0], stdout=fds[1], stderr=fds[2],
                                    cwd=request["workdir"] if self.backend == "bare" else "/",
                                    env=request["env"], start_new_session=True,
                                    preexec_fn=functools.partial(spawn.enter, plan))

    def _wait(self, proc: subprocess.Popen, pipes: dict[str, int], request: dict) -> bool:
        """Until the child ends; kill it when the caller says so or goes away (returned: True)."""
        poller = select.poll()
        pidfd = os.pidfd_open(proc.pid)
        poller.register(pidfd, select.POLLIN)
        poller.register(self.sock, select.POLLIN)
        gone, deadline = False, None
        try:
            while True:
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0) * 1000
                events = dict(poller.poll(timeout))
                if pidfd in events:
                    break
                if self.sock.fileno() in events:
                    msg = self.sock.recv(MAX_MESSAGE)
                    gone = gone or not msg
                    if gone:
                        poller.unregister(self.sock)
                    if deadline is None:
                        deadline = time.monotonic() + STOP_GRACE_S
                        self._kill(proc, pipes, request)
                elif deadline is not None and time.monotonic() >= deadline:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)  # a supervisor that did not comply
                    deadline = time.monotonic() + 3600
        finally:
            os.close(pidfd)
        if self.backend == "bare":
            self._kill(proc, pipes, request)  # what the program left running
        return gone

    def _kill(self, proc: subprocess.Popen, pipes: dict[str, int], request: dict) -> None:
        if self.backend == "namespaces" and self.userns:
            if "control_w" in pipes:
                os.close(pipes.pop("control_w"))  # the supervisor kills the init
        elif self.backend == "bare":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is its pid
            self._kill_leftovers(request)
        else:  # the init, or bwrap: our child, not reaped yet, so the pid cannot have been reused
            os.kill(proc.pid, signal.SIGKILL)

    def _kill_leftovers(self, request: dict) -> None:
        """Bare back end: everything else in our cgroup, else every process of the run's uid."""
        for _ in range(1000) if request["cgroup_procs"] else ():
            pids = {int(p) for f in request["cgroup_procs"] for p in Path(os.fsdecode(f)).read_text().split()}
            pids.discard(os.getpid())
            if not pids:
                break
            for pid in pids:  # pids.max bounds how many can be forked between two reads
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if not request["cgroup_procs"] and request["uid"] is not None:
            fallback.kill_uid(request["uid"])

    def _program_status(self, waitstatus: int, pipes: dict[str, int]) -> int:
        if self.backend == "bare":
            return os.waitstatus_to_exitcode(waitstatus)
        if self.backend == "bwrap":
            code = os.waitstatus_to_exitcode(waitstatus)
            return -(code - 128) if 128 < code < 128 + 32 else code  # bwrap's "killed by signal N"
        data = _read_nonblocking(pipes["status_r"], 4)  # written by the init before it exited
        return os.waitstatus_to_exitcode(struct.unpack("i", data)[0]) if len(data) == 4 else -signal.SIGKILL

    def _clean_up(self, request: dict) -> None:
        if self.backend in ("bare", "bwrap"):  # reap orphans (bwrap's init ends as one)
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline:
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        time.sleep(0.001)  # a child still dying
                except ChildProcessError:
                    break
        if self.backend == "bare" and request["uid"] is not None:
            fallback.remove_leftovers(request["uid"], keep=Path(os.fsdecode(request["workdir"])))


@contextlib.contextmanager
def _children_in_new_pid_namespace(enabled: bool):
    """The calling thread's next fork becomes pid 1 of a new pid namespace; setns restores the
    thread's own afterwards."""
    if not enabled:
        yield
        return
    own = os.open("/proc/thread-self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        spawn._unshare(spawn.CLONE_NEWPID)
        try:
            yield
        finally:
            spawn._check(rootfs._libc.setns(own, spawn.CLONE_NEWPID), "setns back to our pid namespace")
    finally:
        os.close(own)


def _read_nonblocking(fd: int, size: int = 4096) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return b""
