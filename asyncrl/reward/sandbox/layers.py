"""Which isolation this process can have, found once by running `true` in each candidate, most
isolated first, and logged once (a warning naming every layer that could not be had, and why).

Candidates: the kernel's namespaces used directly (as root, or as an unprivileged user through a
user namespace), bubblewrap when installed (the same namespaces and root, for machines where only
bwrap may create them, e.g. where AppArmor restricts unprivileged user namespaces to programs with
a profile; first when code.sandbox.backend is bwrap), then the bare back end: a network namespace
alone, then nothing but rlimits. Independently: a cgroup for memory and processes (root only),
and a uid of its own per run (root only), and the system-call filter (seccomp.py: where the
kernel takes one and there is a syscall table for the architecture).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, replace

from asyncrl.reward.sandbox import cgroups, rootfs, seccomp, spawn
from asyncrl.reward.sandbox.cleanup import remove_tree

log = logging.getLogger("asyncrl.reward.sandbox")
INSTALL_BWRAP = "apt-get install bubblewrap"


@dataclass(frozen=True)
class Isolation:
    backend: str  # bwrap | namespaces | bare
    userns: bool = False  # namespaces through an unprivileged user namespace
    bwrap: str = ""
    net_flags: int = 0  # bare: the network namespace flags that work (0: none)
    slots: cgroups.Slots | None = None
    seccomp: bool = False  # every run under the system-call filter (seccomp.py)
    missing: tuple[str, ...] = ()  # what could not be had, and why

    @property
    def layers(self) -> dict[str, bool]:
        """Layer -> whether runs have it (the README's table, for this machine)."""
        ns = self.backend != "bare"
        return {"filesystem": ns, "pid": ns, "network": ns or bool(self.net_flags), "ipc": ns,
                "uid": os.geteuid() == 0, "cgroup": self.slots is not None,
                "cpu": self.slots is not None and "cpu" in self.slots.hierarchy.dirs, "syscalls": self.seccomp}

    def describe(self) -> str:
        mode = f"{self.backend}{' (user namespace)' if self.userns else ''}"
        cgroup = f"cgroup v{self.slots.hierarchy.version}" if self.slots else "no cgroup"
        have = ", ".join(k for k, v in self.layers.items() if v)
        return f"code sandbox: {mode}, {cgroup}; isolated: {have}"


def isolation(prefer: str = "auto") -> Isolation:
    """The most isolated setup that works here, trying `prefer` (namespaces or bwrap) first; auto:
    namespaces, then bwrap. Probed once per process and preference; forks inherit the result."""
    return _isolation("bwrap" if prefer == "bwrap" else "namespaces")


@functools.cache
def _isolation(prefer: str) -> Isolation:
    root = os.geteuid() == 0
    missing, slots = [], None
    if root:
        slots, why = _cgroup_slots()
        if why:
            missing.append(f"cgroup ({why}): memory is limited per process (RLIMIT_AS), not per run")
        elif "cpu" not in slots.hierarchy.dirs:
            missing.append("cpu cgroup (no cpu and cpuacct controllers here): CPU time is limited per process "
                           "(RLIMIT_CPU), not per run, and a run may take every core")
    else:
        missing += ["cgroup (needs root): memory is limited per process (RLIMIT_AS), not per run, "
                    "and the number of processes only by the wall-clock limit",
                    "uid of its own (needs root): the program runs as this user, without capabilities"]
    bwrap = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin") or ""
    namespaces = Isolation("namespaces", userns=not root, slots=slots)
    candidates = [Isolation("bwrap", bwrap=bwrap, slots=slots)] if bwrap else []
    candidates.insert(len(candidates) if prefer == "bwrap" else 0, namespaces)
    net = spawn.CLONE_NEWNET if root else spawn.CLONE_NEWUSER | spawn.CLONE_NEWNET
    candidates += [Isolation("bare", userns=not root, net_flags=net, slots=slots), Isolation("bare", slots=slots)]
    errors = {}
    for candidate in candidates:
        errors[candidate.backend] = error = _try(candidate)
        if error is None:
            break
    if candidate.backend == "bare":
        why = "; ".join(f"{k}: {v}" for k, v in errors.items() if k != "bare")
        missing.append(f"namespaces ({why}): the program sees the host's files and processes; "
                       "leftovers are found by cgroup or uid")
        if not candidate.net_flags:
            missing.append(f"network namespace ({errors['bare']}): the program can reach the network")
    if prefer == "bwrap" and candidate.backend != "bwrap":
        missing.append(f"bubblewrap ({errors.get('bwrap') or f'not installed: {INSTALL_BWRAP}'})")
    no_filter = seccomp.unavailable(rootfs.libc)
    if no_filter:
        missing.append(f"system-call filter ({no_filter}): the program may make any system call its user may; "
                       "each run gets a fresh session keyring and its uid's keyrings are cleared after it")
    found = replace(candidate, seccomp=no_filter is None, missing=tuple(missing))
    (log.warning if missing else log.info)("%s%s", found.describe(),
                                           "".join(f"\n  missing: {m}" for m in missing))
    return found


def _cgroup_slots() -> tuple[cgroups.Slots | None, str]:
    try:
        hierarchy = cgroups.find()
        if hierarchy is None:
            return None, "no cgroup hierarchy with memory and pids controllers"
        slots = cgroups.Slots(hierarchy)
        slot = slots.create()  # can we create and configure one? (joining is part of the probe runs)
        try:
            slot.prepare(64, 16)
        finally:
            slot.remove()
        return slots, ""
    except OSError as e:
        return None, f"cannot create one here: {e}"


def _try(candidate: Isolation) -> str | None:
    """None if `true` runs in this setup, else why not."""
    from asyncrl.reward.sandbox.runner import probe_run  # runner imports this module

    workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-probe-")
    try:
        result = probe_run(candidate, workdir)
        if result.status == "ok":
            return None
        return (result.stderr.decode("utf-8", "replace").strip().splitlines() or [result.status])[-1][:200]
    finally:
        remove_tree(workdir)
