"""The system-call filter of every sandboxed run: a small seccomp-BPF program of our own, built
here once and installed between the launcher's fork and the program's exec (spawn.py), after
no_new_privs, so the program and everything it starts inherit it and cannot remove it.

Why a program of our own and not libseccomp: the filter is about 60 instructions, installing it
is one prctl (in the forked child, where nothing else should run), and a binding would be one
more native dependency on every reward worker. The cost is keeping two syscall tables (x86_64, aarch64: the architectures this runs on); any
other architecture runs without the filter, reported once as a missing layer (layers.py).

What it refuses, as Docker's default profile does (errno EPERM unless noted):
- kernel keyrings: add_key, keyctl, request_key. Keyrings are not namespaced: the session
  keyring a trainer inherits (Kerberos, AFS/NFS/CIFS credentials) and a uid's user keyring,
  which outlives the run, would otherwise be readable and writable, a channel between samples;
- other processes' memory: ptrace, process_vm_readv/writev, kcmp, pidfd_getfd;
- namespaces and mounts: unshare and clone with CLONE_NEWUSER (the one namespace an
  unprivileged process may create), setns, mount and the new mount API, pivot_root;
- kernel attack surface: bpf, perf_event_open, userfaultfd, io_uring, open_by_handle_at;
- host-wide budgets and views: the AIO calls (one io_setup(65536) takes the whole machine's
  fs.aio-max-nr, and io_setup fails for every other process until the run ends), and inotify and
  fanotify (a watch on the shared read-only /usr shows a run what a concurrent one opens, live);
- the machine: kernel modules, kexec, reboot, swapon/off, acct, quotactl, syslog, iopl/ioperm;
- sockets of any family but AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK (what libc and the
  runtimes use; EAFNOSUPPORT): no AF_VSOCK (not covered by the network namespace: inside a VM it
  reaches the hypervisor's port space), AF_PACKET, AF_ALG, ...;
- clone3 with ENOSYS: its flags are behind a pointer the filter cannot read, and libc falls back
  to clone, whose flags it can;
- system calls of another ABI (x86's int 0x80, x32): ENOSYS, or they would bypass the table.
Everything else is allowed: the other layers (namespaces, uid, rlimits, cgroup) hold the rest.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from pathlib import Path

# classic BPF opcodes (linux/filter.h) and seccomp's return values (linux/seccomp.h)
LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_NO_NEW_PRIVS = 22, 2, 38
NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data (args are u64, little-endian: low half first)
CLONE_NEWUSER = 0x10000000
SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK

REFUSED = ("add_key", "keyctl", "request_key", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
           "pidfd_getfd", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
           "fsconfig", "fsmount", "fspick", "mount_setattr", "bpf", "perf_event_open", "userfaultfd",
           "io_uring_setup", "io_uring_enter", "io_uring_register", "open_by_handle_at", "name_to_handle_at",
           "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
           "swapoff", "acct", "quotactl", "syslog", "iopl", "ioperm",  # iopl, ioperm, inotify_init: x86 only
           "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
           "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark")
# the system calls the filter names, by architecture (asm/unistd_64.h; asm-generic/unistd.h)
TABLES = {
    "x86_64": (0xC000003E, {
        "add_key": 248, "request_key": 249, "keyctl": 250, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438, "setns": 308, "mount": 165, "umount2": 166,
        "pivot_root": 155, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "mount_setattr": 442, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_by_handle_at": 304,
        "name_to_handle_at": 303, "init_module": 175, "finit_module": 313, "delete_module": 176,
        "kexec_load": 246, "kexec_file_load": 320, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
        "quotactl": 179, "syslog": 103, "iopl": 172, "ioperm": 173,
        "io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209, "io_cancel": 210,
        "io_pgetevents": 333, "inotify_init": 253, "inotify_add_watch": 254, "inotify_init1": 294,
        "fanotify_init": 300, "fanotify_mark": 301,
        "unshare": 272, "clone": 56, "clone3": 435, "socket": 41, "socketpair": 53}),
    "aarch64": (0xC00000B7, {
        "add_key": 217, "request_key": 218, "keyctl": 219, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "kcmp": 272, "pidfd_getfd": 438, "setns": 268, "mount": 40, "umount2": 39,
        "pivot_root": 41, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "mount_setattr": 442, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_by_handle_at": 265,
        "name_to_handle_at": 264, "init_module": 105, "finit_module": 273, "delete_module": 106,
        "kexec_load": 104, "kexec_file_load": 294, "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89,
        "quotactl": 60, "syslog": 116,
        "io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_cancel": 3, "io_getevents": 4, "io_pgetevents": 292,
        "inotify_init1": 26, "inotify_add_watch": 27, "fanotify_init": 262, "fanotify_mark": 263,
        "unshare": 97, "clone": 220, "clone3": 435, "socket": 198, "socketpair": 199}),
}
X32_BIT = 0x40000000  # x86_64: x32 system calls are numbered from here


def program(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture as struct sock_filter[] bytes; None where there
    is no table for it."""
    machine = machine or platform.machine()
    if machine not in TABLES:
        return None
    arch, nr = TABLES[machine]
    refused = [nr[name] for name in REFUSED if name in nr]
    code: list[tuple] = [(LD_W_ABS, 0, 0, ARCH), (JEQ, 1, 0, arch), (RET, 0, 0, RET_ERRNO | errno.ENOSYS),
                         (LD_W_ABS, 0, 0, NR)]
    if machine == "x86_64":
        code.append((JGE, "nosys", 0, X32_BIT))
    code += [(JEQ, "eperm", 0, n) for n in refused]
    code += [(JEQ, "nosys", 0, nr["clone3"]),
             (JEQ, "family", 0, nr["socket"]), (JEQ, "family", 0, nr["socketpair"]),
             (JEQ, "newuser", 0, nr["clone"]), (JEQ, "newuser", 0, nr["unshare"]),
             (RET, 0, 0, RET_ALLOW),
             "family", (LD_W_ABS, 0, 0, ARG0),
             *[(JEQ, "allow", 0, family) for family in SOCKET_FAMILIES],
             (RET, 0, 0, RET_ERRNO | errno.EAFNOSUPPORT),
             "newuser", (LD_W_ABS, 0, 0, ARG0), (JSET, "eperm", 0, CLONE_NEWUSER),
             "allow", (RET, 0, 0, RET_ALLOW),
             "eperm", (RET, 0, 0, RET_ERRNO | errno.EPERM),
             "nosys", (RET, 0, 0, RET_ERRNO | errno.ENOSYS)]
    return _assemble(code)


def _assemble(code: list) -> bytes:
    """Resolve the labels (strings in the list) of conditional jumps to relative offsets."""
    labels, at = {}, 0
    for item in code:
        if isinstance(item, str):
            labels[item] = at
        else:
            at += 1
    out, at = [], 0
    for item in code:
        if isinstance(item, str):
            continue
        op, jt, jf, k = item
        jt, jf = (labels[j] - at - 1 if isinstance(j, str) else j for j in (jt, jf))
        if not (0 <= jt <= 255 and 0 <= jf <= 255):
            raise ValueError(f"jump out of range at instruction {at}")
        out.append(struct.pack("=HBBI", op, jt, jf, k))
        at += 1
    return b"".join(out)


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(filter_bytes: bytes, libc) -> int:
    """Install the filter on this process (no_new_privs must be set); 0, or the errno. In a
    forked child: ctypes only, no locks."""
    buf = ctypes.create_string_buffer(filter_bytes, len(filter_bytes))
    prog = _Fprog(len(filter_bytes) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        return ctypes.get_errno()
    return 0


KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR = 1, 7
KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -4, -5


def _keyctl(libc, *args: int) -> int:
    machine = platform.machine()
    if machine not in TABLES:
        return -1
    return libc.syscall(TABLES[machine][1]["keyctl"], *[ctypes.c_long(a) for a in args])


def join_fresh_session_keyring(libc) -> None:
    """Leave the caller's session keyring (a trainer's Kerberos or NFS credentials may be in it)
    for a new empty one that dies with the run: what stands in for the filter's keyctl refusal
    where there is no filter. Kernels without keyrings: nothing to leave."""
    _keyctl(libc, KEYCTL_JOIN_SESSION_KEYRING, 0)


def clear_user_keyrings(libc, proc_keys: Path = Path("/proc/keys")) -> None:
    """Empty this uid's user and user-session keyrings, which outlive its processes (a later run
    with the same uid would find what a program left there). Called as the run's uid. Naming one
    creates it, and the kernel keeps it for good, so only those that exist (listed in /proc/keys,
    which creates nothing) are touched: a run that made none leaves none."""
    uid = os.getuid()
    try:
        listed = proc_keys.read_text()
    except OSError:  # cannot tell: clear both
        listed = None
    for keyring, name in ((KEY_SPEC_USER_KEYRING, f"_uid.{uid}:"), (KEY_SPEC_USER_SESSION_KEYRING, f"_uid_ses.{uid}:")):
        if listed is None or f" {name}" in listed:
            _keyctl(libc, KEYCTL_CLEAR, keyring)


def unavailable(libc) -> str | None:
    """None if a filter can be installed here, else why not (a child process tries it)."""
    filter_bytes = program()
    if filter_bytes is None:
        return f"no system-call table for {platform.machine()}"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
                code = 0 if install(filter_bytes, libc) == 0 else 2
        finally:
            os._exit(code)
    status = os.waitpid(pid, 0)[1]
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return "the kernel refused it (no CONFIG_SECCOMP_FILTER, or a filter of a container forbids it)"
