"""The child side of a sandboxed run: what happens between the launcher's fork and the program's
exec (subprocess's preexec_fn, in a fork of the launcher).

As root (the reward workers here):

    launcher ──Popen──► init (pid 1 of a new pid namespace) ──posix_spawn──► program (pid 2)
                        new mount and ipc namespaces; fresh /tmp, /dev/shm, /sandbox on the
                        launcher's read-only root; its own /proc; then the run's limits, uid and
                        no_new_privs, which the program inherits; reaps, reports its status

The launcher's fork lands in a new pid namespace because the launcher unshares CLONE_NEWPID just
before it (setns puts it back after). The launcher kills a run by SIGKILLing the init, its own
unreaped child (so the pid cannot have been reused): by the kernel's rule for a pid namespace,
every process of the run dies with it, whatever session or process group it moved to. The init
dies with the launcher (PR_SET_PDEATHSIG), and on its own after the wall-clock limit plus a grace,
as a backstop. The program is not pid 1, so signals it sends itself and the CPU limit's SIGXCPU
act as usual; and as pid 1 the init ignores every signal the program may send it but SIGALRM,
with which the program can only end its own run.

The init takes the program's limits and user before it starts the program, so that the program
can be started by posix_spawn (vfork and exec): a fork of the init, itself a fork of the
launcher, cost ~1.5 ms more per run here.

Unprivileged (a user namespace): the launcher's child is a supervisor that creates the user
namespace with all the others and builds the root, forks the init, and waits for it or for the
launcher's word on the control pipe (closed: kill the init); without privileges a process cannot
create a pid namespace for its children and then step back out of it, as the launcher does.

bubblewrap: the launcher's child drops to the run's uid and execs bwrap with the same layout
(rootfs.bwrap_args); bwrap's pid 1 plays the init and dies with it (--die-with-parent).

bare (no namespaces could be created): the launcher's child is the program; the launcher kills
leftovers by cgroup or uid (fallback.py).

Whatever the back end, the launcher's child first joins the run's cgroup slot (cgroups.py), so
that every process of the run is born there and the launcher never is.

The init and the supervisor never exec: they close every inherited file descriptor they do not
need and leave only through os._exit.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import struct
from dataclasses import dataclass

from asyncrl.reward.sandbox import rootfs, seccomp

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 4, 24, 28
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECBIT_NOROOT_AND_LOCKS = 0x1 | 0x2 | 0x20 | 0x40 | 0x80  # noroot (locked), keep_caps off (locked), no ambient raise (locked)
INIT_GRACE_S = 5  # the init gives up this long after the wall-clock limit, if nobody killed it


@dataclass(frozen=True)
class Plan:
    """Everything the child needs, computed in the caller (the child only makes system calls)."""

    backend: str  # namespaces | bwrap | bare
    userns: bool  # namespaces through an unprivileged user namespace
    uid: int | None  # the run's own uid (when the caller is root)
    workdir: bytes  # the caller's run directory
    root: bytes  # where the new root is: the launcher's template, or (userns) built on workdir
    persist: bool  # bind the run directory read-write instead of copying it into a tmpfs
    steps: tuple  # rootfs.layout
    tmpfs_mb: int
    rlimits: tuple[tuple[int, int, int], ...]  # (resource, soft, hard)
    control_fd: int  # the supervisor kills the run when this becomes readable (EOF)
    status_fd: int  # the init writes the program's wait status here
    error_fd: int  # where the child writes why it failed, before subprocess reports the failure
    wall_s: int  # the init's own deadline (a backstop)
    argv: tuple[str, ...]  # the program and its arguments
    env: tuple[tuple[str, str], ...]  # its environment
    bwrap: str = ""  # bubblewrap's path
    cap_last: int = 40  # the highest capability number this kernel knows
    seccomp: bytes = b""  # the system-call filter (seccomp.program), b"": none here
    cgroup_join: tuple[bytes, ...] = ()  # the run's slot (cgroups.Slot.join_files), joined first


def enter(plan: Plan) -> None:
    """preexec_fn of the run (in a new session already). Returns only in the process that then
    execs the program; the init and the supervisor never return."""
    try:
        _enter(plan)
    except BaseException as e:  # subprocess only says "Exception occurred in preexec_fn"
        os.write(plan.error_fd, f"{type(e).__name__}: {e}".encode()[:1000])
        raise


def _enter(plan: Plan) -> None:
    for path in plan.cgroup_join:  # before anything is allocated: the run's memory is the slot's,
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)  # the launcher's never is (it stays out)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    if plan.backend == "bare":  # (the launcher made the network namespace, if any)
        _drop_privileges(plan)
        return
    rootfs.libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if plan.backend == "bwrap":
        _exec_bwrap(plan, _open_dir(plan.workdir))
    if not plan.userns:  # pid 1 of a new pid namespace already, in the launcher's net and uts ones
        unshare(CLONE_NEWNS | CLONE_NEWIPC)
        rootfs.mount_run(plan.root, _open_dir(plan.workdir), plan.persist, plan.uid, plan.tmpfs_mb)
        _init(plan)
    enter_user_namespace(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWPID)
    rootfs.mount(None, b"/", None, rootfs.MS_REC | rootfs.MS_PRIVATE)
    run_dir_fd = _open_dir(plan.workdir)  # (a bind's source must be in this mount namespace)
    rootfs.build_template(plan.root, plan.steps)
    rootfs.mount_run(plan.root, run_dir_fd, plan.persist, 0, plan.tmpfs_mb)
    rootfs.libc.sethostname(b"sandbox", 7)
    init = os.fork()
    if init == 0:
        rootfs.libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a fork does not inherit it
        _init(plan)
    _supervise(init, plan.control_fd)


def _init(plan: Plan) -> None:
    """pid 1 of the run: starts the program and reaps until it ends. Never returns."""
    unshare(CLONE_NEWCGROUP)  # the run sees its cgroup as the root of the hierarchy
    rootfs.enter(plan.root)
    os.chdir(rootfs.RUN_DIR)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)  # not the caller's handlers: as pid 1, ignored
    signal.signal(signal.SIGALRM, _give_up)  # pid 1 ignores a default action: a handler
    # From here on this process only waits: it takes the program's limits and user, so that the
    # program can be started by posix_spawn (vfork and exec), not by a fork of this process.
    _drop_privileges(plan)
    rootfs.libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a change of user clears it
    rootfs.libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the program may not read this process's memory
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2:  # the program inherits stdin, stdout and stderr only
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)
    program = os.posix_spawn(plan.argv[0], list(plan.argv), dict(plan.env), setsigmask=(),
                             setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGALRM))
    try:
        _close_all_but(plan.status_fd)  # subprocess's error pipe too: the caller's Popen returns
        signal.alarm(plan.wall_s + INIT_GRACE_S)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == program and os.WIFSTOPPED(status):  # only a tracer sees a stop: a
                os.kill(program, signal.SIGKILL)  # program that traces itself ends here
            elif pid == program:
                os.write(plan.status_fd, struct.pack("i", status))
                break
    finally:
        os._exit(0)  # the kernel now kills whatever is left in the namespace


def _give_up(signum, frame) -> None:
    os._exit(0)


def _supervise(init: int, control_fd: int) -> None:
    """Wait for the init to end or the control pipe to become readable (then kill the init: as
    our unreaped child its pid cannot have been reused). Never returns."""
    try:
        _close_all_but(control_fd)
        poller = select.poll()
        poller.register(control_fd, select.POLLIN)
        pidfd = os.pidfd_open(init)
        poller.register(pidfd, select.POLLIN)
        if any(fd == control_fd for fd, _ in poller.poll()):
            os.kill(init, signal.SIGKILL)
        os.waitpid(init, 0)
    finally:
        os._exit(0)


def _exec_bwrap(plan: Plan, run_dir_fd: int) -> None:
    files = []
    if not plan.persist:
        for entry in os.scandir(run_dir_fd):
            if entry.is_file(follow_symlinks=False):
                fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=run_dir_fd)
                files.append((fd, entry.name, os.fstat(fd).st_mode))
    for fd in [fd for fd, _, _ in files] + [run_dir_fd]:
        os.set_inheritable(fd, True)
    args = rootfs.bwrap_args(plan.steps, files, run_dir_fd if plan.persist else None, plan.tmpfs_mb)
    if plan.seccomp:  # bwrap installs it just before it execs the program (no_new_privs included)
        read, write = os.pipe()  # the filter (< 1 KiB) fits the pipe's buffer
        os.write(write, plan.seccomp)
        os.close(write)
        os.set_inheritable(read, True)
        args = ["--seccomp", str(read), *args]
    _drop_privileges(plan, no_new_privs=False)  # bwrap is not setuid here: it needs no privileges
    os.execve(plan.bwrap, [plan.bwrap, *args, *plan.argv], dict(plan.env))


def _drop_privileges(plan: Plan, no_new_privs: bool = True) -> None:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # the OOM killer (the cgroup's, or the host's) takes the program first
    for res, soft, hard in plan.rlimits:
        resource.setrlimit(res, (soft, hard))
    if plan.uid is not None:
        os.setgroups([])
        os.setresgid(plan.uid, plan.uid, plan.uid)
        os.setresuid(plan.uid, plan.uid, plan.uid)  # as root: no way back
    elif plan.userns:  # root of its user namespace: no capabilities
        rootfs.check(rootfs.libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT_AND_LOCKS, 0, 0, 0), "securebits")
        for cap in range(plan.cap_last + 1):
            rootfs.check(rootfs.libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop a capability")
        rootfs.libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    seccomp.join_fresh_session_keyring(rootfs.libc)  # as the run's user: its own, empty
    if no_new_privs:
        rootfs.check(rootfs.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        if plan.seccomp:  # last: the filter refuses keyctl, and the program inherits it
            error = seccomp.install(plan.seccomp, rootfs.libc)
            if error:
                raise OSError(error, f"seccomp filter: {os.strerror(error)}")


def enter_user_namespace(flags: int) -> None:
    """Unshare a user namespace (with `flags`) in which this process's user is root."""
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER | flags)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _open_dir(path: bytes) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _close_all_but(keep: int) -> None:
    os.closerange(0, keep)
    os.closerange(keep + 1, max(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1024))


def unshare(flags: int) -> None:
    rootfs.check(rootfs.libc.unshare(flags), f"unshare({flags:#x})")
