"""The launcher: a small process of its own that starts and ends the runs of one caller, one run
at a time (this module is the caller's side; server.py is the launcher's).

    caller (a reward worker) ──socket──► launcher ──fork──► init (pid 1) ──posix_spawn──► program

Why not fork from the caller: a reward worker holds sympy and math-verify (~80 MB), and forking
it cost 5 ms here, twice per run, where a bare subprocess.run uses vfork (0.5 ms). The launcher is
a fresh `python -I -S` holding only this package (~17 MB), started once per concurrent run. It
also keeps, for all its runs:
- its cgroup slot (cgroups.py), which each run's first process joins (spawn.py); the launcher
  itself stays in the caller's cgroup, where no run's memory is charged, so that no run, however
  it fills its slot (memory it parks past its end included), can get the launcher OOM-killed;
- as root, its network and uts namespaces. The network namespace is replaced after each run
  (server.py), once the run's result is sent: one shared by the launcher's runs let an abstract
  Unix socket that a program kept alive past its end, through a descriptor cycle over
  SCM_RIGHTS, reach the next run; made in the run's own child it cost ~2-3 ms per run;
- as root, a private mount namespace with the read-only part of the root built once per layout
  (rootfs.build_template); each run gets its own mount, ipc and pid namespaces on top.

Protocol (SOCK_SEQPACKET, pickled tuples; the run's stdin, stdout and stderr travel as fds):
    caller: ("run", request) [stdin, stdout, stderr]   launcher: ("started",) or ("error", why)
    caller: ("kill",)                                  launcher: ("exited", returncode, cpu_s)
The launcher answers "exited" after the run ended by itself or was killed; EOF on the socket (the
caller exited or died, a reward worker killed with SIGKILL included) kills the run and ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from asyncrl.reward.sandbox.cleanup import remove_tree

STOP_GRACE_S = 5.0  # a killed run that has not ended by then: SIGKILL its whole process group
ROOT_DIR = Path(__file__).resolve().parents[3]  # the directory holding the asyncrl package
# The package's place and the config come over the socket: a run's init is a fork of the launcher,
# and its command line is readable in the run's /proc.
BOOT = ("import os, sys; fd = int(sys.argv[1]); sys.path.insert(0, os.read(fd, 4096).decode()); "
        "from asyncrl.reward.sandbox.server import serve; serve(fd)")
MAX_MESSAGE = 1 << 20
START_TIMEOUT_S = 30.0  # a launcher that takes longer to start a run is taken for dead
STAGING_PREFIX = "asyncrl-sandbox-root-"


class Launcher:
    """The caller's handle on one launcher process (see the module docstring)."""

    def __init__(self, config: dict, slot=None):
        """config: backend, userns, net_flags, bwrap (layers.Isolation); slot: the cgroup it
        lives in, or None."""
        self.slot = slot
        self.error = b""  # why the launcher gave up on its run (its own fault, not the program's)
        self.staging = ""  # the templates' mount point (an empty directory on the host)
        if config["backend"] == "namespaces" and not config["userns"]:
            self.staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", BOOT, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        theirs.close()
        ours.send(str(ROOT_DIR).encode())
        ours.send(json.dumps({**config, "staging": self.staging}).encode())
        reply = self._recv(60)
        if reply != ("ready",):
            self.close()
            why = reply[1].decode("utf-8", "replace") if reply and reply[0] == "error" else "no answer"
            raise OSError(f"the sandbox launcher did not start: {why}")

    def start(self, request: dict, fds: list[int]) -> bytes | None:
        """Start a run; None once it runs, else why it could not start."""
        socket.send_fds(self.sock, [pickle.dumps(("run", request))], fds)
        reply = self._recv(START_TIMEOUT_S)
        if reply is None:  # dead or stuck: make sure it is dead, so that it gets replaced
            self.proc.kill()
            self.proc.wait()
            return b"the sandbox launcher did not answer"
        return None if reply[0] == "started" else reply[1]

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(pickle.dumps(("kill",)))

    def result(self, timeout_s: float | None) -> tuple[int, float] | None:
        """(the program's return code, the run's CPU seconds), or None: the launcher broke."""
        reply = self._recv(timeout_s)
        if reply is not None and reply[0] == "error":
            self.error = reply[1]
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

    def renew_slot(self, launcher: Launcher) -> None:
        """Give a launcher a fresh slot and put it back: its last run left memory charged to the
        old one, which would count against the next run. A launcher that cannot get one ends."""
        old = launcher.slot
        try:
            launcher.slot = self.slots.create()
        except OSError:
            launcher.slot = old
            self.discard(launcher)
            return
        old.remove()  # (a cgroup that still holds charges goes offline until they are freed)
        self.put_back(launcher)

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
