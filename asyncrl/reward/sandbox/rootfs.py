"""The file system a sandboxed run sees: a root of its own, in a mount namespace of its own.

    /            tmpfs, read-only
    /usr ...     read-only binds of the system directories (/bin, /lib... as the host's symlinks)
    /etc/...     read-only binds of the few files the dynamic loader reads
    <prefix>     a read-only bind of an interpreter's prefix when it lives outside /usr (pyenv, conda)
    /dev         tmpfs with null, zero, full, random, urandom bound from the host, fd/std* links
    /proc        a proc of the run's own pid namespace (mounted by its init, `enter`)
    /tmp         fresh tmpfs per run, size-capped (its pages are charged to the run's cgroup)
    /dev/shm     likewise
    /sandbox     the run directory, the only other writable place: a tmpfs holding a copy of the
                 caller's run directory, or (persist=True, for a compiler's output) that directory
                 itself, bound read-write

Nothing else of the host is there: not the project, not runs/, not the host's /tmp (Ray's session
directories and sockets), not other processes' /proc entries. What the run writes vanishes with
its mount namespace when its last process exits.

The read-only part is a list of plain steps computed in the caller (`layout`), built once as a
template by the launcher (`build_template`), under which every run mounts its own tmpfs
(`mount_run`) and its /proc, then switches root (`enter`). The same steps translate into
bubblewrap's arguments (`bwrap_args`), so both back ends give the same view.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 2
_KEEP_FLAGS = 0x8 | 0x400 | 0x800 | 0x1000  # noexec, noatime, nodiratime, relatime (ST_* = MS_*)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
             "/etc/localtime")
DEVICES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = (("/proc/self/fd", "fd"), ("/proc/self/fd/0", "stdin"), ("/proc/self/fd/1", "stdout"),
             ("/proc/self/fd/2", "stderr"))
RUN_DIR = "/sandbox"
RUN_TMPFS = ("/tmp", "/dev/shm")  # fresh for every run, like the run directory
libc = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls it
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

Step = tuple  # ("dir" | "symlink" | "ro" | "dev" | "tmpfs", ...): see layout()


@functools.cache
def system_steps(executables: tuple[str, ...]) -> tuple[Step, ...]:
    """The read-only part of the root: system directories, loader files, and the prefix of each
    absolute executable that is not under them (e.g. a pyenv or conda Python)."""
    steps: list[Step] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            steps.append(("symlink", os.readlink(d), d))
        elif os.path.isdir(d):
            steps.append(("ro", d, d))
    steps.append(("dir", "/etc"))
    steps += [("ro", f, f) for f in ETC_FILES if os.path.exists(f)]
    covered = [os.path.realpath(d) for d in SYSTEM_DIRS if os.path.isdir(d)]
    for exe in executables:
        if not os.path.isabs(exe):
            continue  # the program itself, in the run directory
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(exe)))  # <prefix>/bin/python3
        if not any(prefix == c or prefix.startswith(c + "/") for c in covered):
            steps += [("dir", p) for p in _parents(prefix)] + [("ro", prefix, prefix)]
            covered.append(prefix)
    return tuple(steps)


def _parents(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def layout(executables: tuple[str, ...]) -> tuple[Step, ...]:
    """The steps of the read-only part of the root (a template built once per launcher), in
    order; the per-run tmpfs mounts (mount_run) and /proc (enter) come on top."""
    return (*system_steps(executables),
            ("dir", "/dev"), ("tmpfs", "/dev", 1 << 20, 0o755), *[("dev", f"/dev/{d}") for d in DEVICES],
            *[("symlink", target, f"/dev/{name}") for target, name in DEV_LINKS],
            *[("dir", d) for d in (*RUN_TMPFS, "/proc", RUN_DIR)])


# -- executed in the child, between fork and exec -------------------------------------------------

def check(result: int, what: str) -> None:
    """Raise OSError with errno when a libc call failed."""
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None = None) -> None:
    check(libc.mount(source, target, fstype, flags, data), f"mount {target!r}")


def _bind_readonly(source: bytes, target: bytes) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    # A remount must keep the flags the source was mounted with (in a user namespace they are
    # locked), plus read-only, nosuid (setuid binaries under /usr stay plain files) and nodev.
    keep = os.statvfs(target).f_flag & _KEEP_FLAGS
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)


def build_template(root: bytes, steps: tuple[Step, ...]) -> None:
    """Mount a tmpfs on `root` and build the read-only part of a sandbox's root in it."""
    mount(b"tmpfs", root, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755")
    for step in steps:
        _apply(root, step)
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def mount_run(root: bytes, run_dir_fd: int, persist: bool, owner: int | None, tmpfs_mb: int) -> None:
    """In the run's own mount namespace, on a template: fresh /tmp, /dev/shm and run directory
    (a copy of the caller's, or with persist the caller's bound read-write; run_dir_fd is open)."""
    for d in RUN_TMPFS:
        _tmpfs(root + d.encode(), tmpfs_mb << 20, 0o1777, None)
    run_dir = root + RUN_DIR.encode()
    if persist:
        mount(f"/proc/self/fd/{run_dir_fd}".encode(), run_dir, None, MS_BIND)
    else:
        _tmpfs(run_dir, tmpfs_mb << 20, 0o700, owner)
        _copy_files(run_dir_fd, run_dir, owner)


def _apply(root: bytes, step: Step) -> None:
    kind, *args = step
    if kind == "dir":
        os.makedirs(root + args[0].encode(), mode=0o755, exist_ok=True)
    elif kind == "symlink":
        os.symlink(args[0], root + args[1].encode())
    elif kind in ("ro", "dev"):
        source, target = args[0].encode(), root + args[-1].encode()
        if os.path.isdir(source):
            os.makedirs(target, mode=0o755, exist_ok=True)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
        if kind == "dev":  # device nodes: a plain bind (a read-only mount would not stop writes anyway)
            mount(source, target, None, MS_BIND)
        else:
            _bind_readonly(source, target)
    elif kind == "tmpfs":
        _tmpfs(root + args[0].encode(), args[1], args[2], None)
    else:
        raise ValueError(f"unknown layout step {kind!r}")


def _tmpfs(target: bytes, size: int, mode: int, owner: int | None) -> None:
    data = f"size={size},nr_inodes=65536,mode={mode:o}"
    if owner is not None:
        data += f",uid={owner},gid={owner}"
    mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, data.encode())


def _copy_files(src_fd: int, dest: bytes, owner: int | None) -> None:
    """Copy the regular files at the top of the run directory (the solution, a compiled binary)."""
    for entry in os.scandir(src_fd):
        if not entry.is_file(follow_symlinks=False):
            continue
        fd_in = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
        try:
            mode = os.fstat(fd_in).st_mode & 0o755
            fd_out = os.open(dest + b"/" + entry.name.encode(), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            try:
                while chunk := os.read(fd_in, 1 << 20):
                    os.write(fd_out, chunk)
                if owner is not None:
                    os.fchown(fd_out, owner, owner)
            finally:
                os.close(fd_out)
        finally:
            os.close(fd_in)


def enter(root: bytes) -> None:
    """In the run's init (pid 1 of its pid namespace): mount its /proc, make `root` the root of
    this mount namespace with the host's root detached."""
    mount(b"proc", root + b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # before the host's goes
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is not None and libc.syscall(number, b".", b".") == 0:
        check(libc.umount2(b".", MNT_DETACH), "umount the old root")  # stacked on "." by pivot_root
    else:  # an unknown architecture, or / is not a mount point: chroot (the program is not root)
        os.chroot(".")
    os.chdir("/")


# -- bubblewrap -----------------------------------------------------------------------------------

def bwrap_args(steps: tuple[Step, ...], files: list[tuple[int, str, int]], run_dir_fd: int | None,
               tmpfs_mb: int) -> list[str]:
    """bubblewrap options giving the same view: `files` are (open fd, name, mode) to copy into the
    run directory, or run_dir_fd is bound there read-write (persist)."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    for kind, *rest in steps:
        if kind in ("dir", "symlink", "dev") and rest[-1].startswith("/dev/"):
            continue  # bubblewrap's --dev makes them
        if kind == "dir":
            args += ["--dir", rest[0]]
        elif kind == "symlink":
            args += ["--symlink", rest[0], rest[1]]
        elif kind == "ro":
            args += ["--ro-bind", rest[0], rest[1]]
        elif kind == "tmpfs" and rest[0] == "/dev":
            args += ["--dev", "/dev"]  # bubblewrap's own /dev: the same devices and links
        elif kind == "tmpfs":
            args += ["--perms", f"{rest[2]:o}", "--size", str(rest[1]), "--tmpfs", rest[0]]
    for d in RUN_TMPFS:
        args += ["--perms", "1777", "--size", str(tmpfs_mb << 20), "--tmpfs", d]
    args += ["--proc", "/proc"]
    if run_dir_fd is not None:
        args += ["--bind-fd", str(run_dir_fd), RUN_DIR]
    else:
        args += ["--perms", "700", "--size", str(tmpfs_mb << 20), "--tmpfs", RUN_DIR]
        for fd, name, mode in files:
            args += ["--perms", f"{mode & 0o755:o}", "--file", str(fd), f"{RUN_DIR}/{name}"]
    return [*args, "--remount-ro", "/", "--chdir", RUN_DIR, "--"]

