"""Run one untrusted program (a model's solution) in a sandbox; the code verifier's executor.

    run_sandboxed(argv, stdin, limits, workdir) -> RunResult(status, returncode, stdout, stderr, ...)

status: ok, crashed (nonzero exit or SIGSEGV/SIGABRT/SIGFPE/SIGBUS/SIGILL), timeout (wall limit,
or the CPU limit's SIGXCPU/SIGKILL), memory (the run's cgroup hit its limit and the OOM killer
acted, or MemoryError / std::bad_alloc / out of memory on stderr), output_limit (stdout or stderr
over max_output_kb), killed (any other signal), sandbox_error (the sandbox itself could not start
the program).

How (the modules, in the order a run goes through them):

    runner.run_sandboxed ─► launcher.Launcher (one small process per concurrent run, with a cgroup slot)
      ─► server (in it) ─► spawn (joins the slot, between the fork and the program's exec) ─► rootfs (the new root)
    layers.isolation: which setup works here, found once; cgroups: the memory and pids limits;
    seccomp: the system-call filter; cleanup.remove_tree: host directories, whatever was written
    in them; fallback: no namespaces

What a run is isolated by, layer by layer (layers.py finds which this machine allows and logs the
missing ones once):

| layer | how | without root |
|---|---|---|
| file system | mount namespace, new root: read-only system dirs, fresh /tmp, /dev/shm, run dir (rootfs.py) | same, in a user namespace |
| processes | pid namespace with its own /proc; killing its init kills every process of the run | same |
| network | a network namespace per run with only a loopback that is down (no TCP, no abstract Unix socket of the host or of another run) | same |
| system calls | a seccomp filter (seccomp.py): no keyrings, ptrace, mounts, new user namespaces, bpf, io_uring or AIO, inotify, kernel modules; sockets of AF_UNIX, AF_INET(6) and AF_NETLINK only (no vsock) | same |
| kernel keyrings | a fresh empty session keyring per run; without the filter, the uid's keyrings cleared after it | same, but not cleared |
| System V IPC, hostname | ipc and uts namespaces | same |
| privileges | a uid of its own per run, no_new_privs, nosuid mounts | root of a user namespace with every capability dropped |
| memory, processes, CPU | a cgroup per launcher (v1 memory+pids+cpu+cpuacct, or v2): the tree's memory, processes, cores (cpu_cores) and CPU time (cpu_time_s), and what a run parks past its end collected before the next (runner.py); RLIMIT_AS per process | RLIMIT_AS per process only; no process limit but the wall clock |
| time, files, output | RLIMIT_CPU per process, wall clock, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE 1, tmpfs sizes, output cap | same |

The kernel's namespaces are used directly (spawn.py); bubblewrap (`apt-get install bubblewrap`)
builds the same ones and the same root where that is not possible, or when asked. Where no
namespace can be made at all (e.g. root in a container without CAP_SYS_ADMIN), the bare back end
remains: rlimits, a network namespace if possible, a uid of its own and clean-up by cgroup or uid
(fallback.py).

Not protected: kernel bugs in the system calls the filter allows; what it reads is what the
system directories hold (world-readable files under /usr, the loader's files in /etc).
"""

from asyncrl.reward.sandbox.cleanup import remove_tree
from asyncrl.reward.sandbox.layers import Isolation, isolation
from asyncrl.reward.sandbox.runner import SANDBOX_UID_BASE, RunResult, kill_active, release, run_sandboxed

__all__ = ["SANDBOX_UID_BASE", "Isolation", "RunResult", "isolation", "kill_active", "release", "remove_tree",
           "run_sandboxed"]
