"""The launcher process's side (launcher.py says why it exists and what its protocol is): set up
its namespaces and cgroup once, then start, watch, kill and reap one run at a time.

Started as `python -I -S -c launcher.BOOT`: only the standard library and this package are
imported, so it stays small (its forks are the runs' inits).
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
import time
from pathlib import Path

from asyncrl.reward.sandbox import fallback, rootfs, seccomp, spawn
from asyncrl.reward.sandbox.launcher import MAX_MESSAGE, STOP_GRACE_S


def serve(sock_fd: int) -> None:
    """The launcher's main loop (started by Launcher with `python -I -S -c BOOT`)."""
    sock = socket.socket(fileno=sock_fd)
    config = json.loads(sock.recv(MAX_MESSAGE))
    sock.set_inheritable(False)  # no run may inherit it
    try:
        server = _Server(sock, config)
    except Exception as e:  # why it cannot start goes to the caller, not to the trainer's console
        sock.send(pickle.dumps(("error", f"{e!r}".encode()[:1000])))
        return
    sock.send(pickle.dumps(("ready",)))
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
        except OSError:
            return
        if not msg:
            return  # the caller is gone
        request = pickle.loads(msg)
        try:
            if request[0] == "run" and server.run(request[1], fds):
                return
        except Exception as e:  # a fault of the launcher's own: the run's result (sandbox_error),
            with contextlib.suppress(OSError):  # then this launcher ends and is replaced
                sock.send(pickle.dumps(("error", f"sandbox launcher: {e!r}".encode()[:1000])))
            return


class _Server:
    def __init__(self, sock: socket.socket, config: dict):
        self.sock, self.backend, self.userns = sock, config["backend"], config["userns"]
        self.net_flags, self.bwrap = config["net_flags"], config["bwrap"]
        self.filter = (seccomp.program() or b"") if config["seccomp"] else b""
        self.staging = config["staging"].encode()
        self.templates: dict[tuple, bytes] = {}
        if self.backend == "namespaces" and not self.userns:
            spawn.unshare(spawn.CLONE_NEWNS | spawn.CLONE_NEWNET | spawn.CLONE_NEWUTS)
            rootfs.mount(None, b"/", None, rootfs.MS_REC | rootfs.MS_PRIVATE)  # nothing leaks to the host
            rootfs.mount(b"tmpfs", self.staging, b"tmpfs", rootfs.MS_NOSUID | rootfs.MS_NODEV, b"size=1m,mode=0755")
            rootfs.libc.sethostname(b"sandbox", 7)
        elif self.backend == "bare" and self.net_flags & spawn.CLONE_NEWUSER:
            spawn.enter_user_namespace(spawn.CLONE_NEWNET)
        elif self.backend == "bare" and self.net_flags:
            spawn.unshare(self.net_flags)
        if self.backend in ("bare", "bwrap"):
            fallback.become_subreaper()  # every orphan of a run is ours to reap (we have no others)
        # Outside every run's cgroup, so no run's memory limit can get it OOM-killed; for the
        # host's own OOM killer, never its choice where it may say so (CAP_SYS_RESOURCE; a run's
        # programs raise theirs to 1000 before they start, spawn.py).
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")

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
            proc = None
        finally:  # the child's ends, and the caller's fds: the child has its own copies
            for fd in [*fds, *(pipes.pop(k) for k in ("status_w", "error_r", "error_w", "control_r"))]:
                os.close(fd)
        if proc is None:
            for fd in pipes.values():
                os.close(fd)
            return False
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
        if self.backend == "namespaces" and not self.userns:
            # the next run in a network namespace of its own: an abstract Unix socket that a
            # program kept alive past its end (a descriptor cycle over SCM_RIGHTS lives until the
            # kernel collects it) stays in this one, out of reach. Made after the answer, so the
            # caller's work on this run's output overlaps it (~2-3 ms with the kernel's clean-up)
            spawn.unshare(spawn.CLONE_NEWNET)
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
            env=tuple(request["env"].items()), bwrap=self.bwrap, cap_last=request["cap_last"],
            seccomp=self.filter if request["seccomp"] else b"", cgroup_join=tuple(request["cgroup_join"]))
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
        """Bare back end: everything in the run's cgroup, else every process of the run's uid."""
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
        return _exit_code(struct.unpack("i", data)[0]) if len(data) == 4 else -signal.SIGKILL

    def _clean_up(self, request: dict) -> None:
        if not request["seccomp"] and request["uid"] is not None:  # no filter: keys the program left
            _as_user(request["uid"], seccomp.clear_user_keyrings)
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
        spawn.unshare(spawn.CLONE_NEWPID)
        try:
            yield
        finally:
            rootfs.check(rootfs.libc.setns(own, spawn.CLONE_NEWPID), "setns back to our pid namespace")
    finally:
        os.close(own)


def _exit_code(status: int) -> int:
    """The return code of a wait status (negative: the signal), for any status: one that is not
    an end (a stop, or nonsense) counts as killed, never an exception in the launcher."""
    try:
        return os.waitstatus_to_exitcode(status)
    except ValueError:
        return -signal.SIGKILL


def _as_user(uid: int, fn) -> None:
    """fn(libc) in a child process that has become `uid` (the launcher stays root)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            fn(rootfs.libc)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _read_nonblocking(fd: int, size: int = 4096) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return b""
