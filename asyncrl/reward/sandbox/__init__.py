"""Run one untrusted program (a model's solution) in a sandbox; the code verifier's executor.

    run_sandboxed(argv, stdin, limits, workdir) -> RunResult(status, returncode, stdout, stderr, ...)

status: ok, crashed (nonzero exit or SIGSEGV/SIGABRT/SIGFPE/SIGBUS/SIGILL), timeout (wall limit,
or the CPU limit's SIGXCPU/SIGKILL), memory (the run's cgroup hit its limit and the OOM killer
acted, or MemoryError / std::bad_alloc / out of memory on stderr), output_limit (stdout or stderr
over max_output_kb), killed (any other signal), sandbox_error (the sandbox itself could not start
the program).

How (the modules, in the order a run goes through them):

    runner.run_sandboxed ─► launcher.Launcher (one small process per concurrent run, in its cgroup)
      ─► server (in it) ─► spawn (between its fork and the program's exec) ─► rootfs (the new root)
    layers.isolation: which setup works here, found once; cgroups: the memory and pids limits;
    cleanup.remove_tree: host directories, whatever was written in them; fallback: no namespaces

What a run is isolated by, layer by layer (layers.py finds which this machine allows and logs the
missing ones once):

| layer | how | without root |
|---|---|---|
| file system | mount namespace, new root: read-only system dirs, fresh /tmp, /dev/shm, run dir (rootfs.py) | same, in a user namespace |
| processes | pid namespace with its own /proc; killing its init kills every process of the run | same |
| network | a network namespace with only a loopback that is down (no TCP, no abstract Unix socket of the host) | same |
| System V IPC, hostname | ipc and uts namespaces | same |
| privileges | a uid of its own per run, no_new_privs, nosuid mounts | root of a user namespace with every capability dropped |
| memory, processes | a cgroup per launcher (v1 memory+pids, or v2), and RLIMIT_AS per process | RLIMIT_AS per process only; no process limit but the wall clock |
| time, files, output | RLIMIT_CPU, wall clock, RLIMIT_FSIZE, tmpfs sizes, output cap | same |

The kernel's namespaces are used directly (spawn.py); bubblewrap (`apt-get install bubblewrap`)
builds the same ones and the same root where that is not possible, or when asked. Where no
namespace can be made at all (e.g. root in a container without CAP_SYS_ADMIN), the bare back end
remains: rlimits, a network namespace if possible, a uid of its own and clean-up by cgroup or uid
(fallback.py).

Not protected: there is no seccomp filter, so the program can make any system call its user may
(kernel bugs are out of scope); what it reads is what the system directories hold (world-readable
files under /usr, the loader's files in /etc).
"""

from asyncrl.reward.sandbox.cleanup import remove_tree
from asyncrl.reward.sandbox.layers import Isolation, isolation
from asyncrl.reward.sandbox.runner import SANDBOX_UID_BASE, RunResult, kill_active, release, run_sandboxed

__all__ = ["SANDBOX_UID_BASE", "Isolation", "RunResult", "isolation", "kill_active", "release", "remove_tree",
           "run_sandboxed"]
