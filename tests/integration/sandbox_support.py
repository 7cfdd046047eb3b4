"""Shared by the sandbox tests: short limits, response builders, and the check that a test left
nothing behind (no process, cgroup, mount or directory), made from outside the sandbox.

The preconditions are checked, not assumed: as root (CI, these machines) every layer must be
there, and a test fails loudly if one is not; without root the tests assert the degraded
behaviour that the README's table describes.
"""

import os
import tempfile
import textwrap
from pathlib import Path

import pytest

from asyncrl.config import CodeRewardConfig, SandboxConfig
from asyncrl.reward import code_reward
from asyncrl.reward.code_reward import CodeReward
from asyncrl.reward.sandbox import SANDBOX_UID_BASE, cgroups, isolation, remove_tree, run_sandboxed, runner

ROOT = os.geteuid() == 0
LIMITS = SandboxConfig(wall_time_s=2.0, cpu_time_s=1, memory_mb=256, max_processes=8, max_file_mb=1,
                       max_output_kb=64, compile_time_s=30)
SLACK_S = 1.5
F = "```"


def limits(backend="auto", **kw):
    return LIMITS.model_copy(update={"backend": backend, **kw})


def verifier(mode="all_pass", backend="auto", **kw):
    return CodeReward(CodeRewardConfig(mode=mode, sandbox=limits(backend), **kw))


def run_python(code, workdir, backend="auto", stdin=b"", **kw):
    """run_sandboxed on a Python one-off, without the verifier (to see status, output and uid)."""
    return run_sandboxed([code_reward.PYTHON, "-I", "-S", "-c", textwrap.dedent(code)], stdin,
                         limits(backend, **kw), workdir)


def py(code):
    return f"Here is my solution.\n{F}python\n{textwrap.dedent(code).strip()}\n{F}\n"


def cpp(code):
    return f"{F}cpp\n#include <iostream>\n#include <vector>\n{textwrap.dedent(code).strip()}\n{F}"


def stdio(output, stdin=""):
    return [{"type": "stdio", "input": stdin, "output": output}]


def require_isolation(backend="auto"):
    """The isolation runs get; as root every layer must be there (bwrap only where installed)."""
    iso = isolation(backend)
    if ROOT:
        wanted = "bwrap" if backend == "bwrap" and iso.bwrap else "namespaces"
        assert iso.backend == wanted and iso.slots is not None, f"{iso.describe()}; missing: {iso.missing}"
        assert all(iso.layers.values()), iso.layers
    return iso


def our_uids():
    """The range of uids this process gives its runs (SANDBOX_UID_BASE + its pid's bits + n)."""
    first = SANDBOX_UID_BASE + ((os.getpid() & 0x3F_FFFF) << 6)
    return range(first, first + 64)


def sandbox_processes():
    """(pid, parent pid, state) of the processes running as one of our runs' uids."""
    found, uids = [], our_uids()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) in uids:
            found.append((int(name), int(fields["PPid"]), fields["State"].strip()[0]))
    return found


def children():
    """Processes whose parent is this one (launchers, runs), zombies included."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == os.getpid():
            found.append(int(name))
    return found


@pytest.fixture(autouse=True)
def nothing_left_behind(tmp_path_factory, monkeypatch):
    """Each test gets a temp dir of its own (so other work on the machine does not count); after
    it, once this process's launchers are ended: no new child of this process (children from
    before the test, such as multiprocessing's forkserver left by earlier test modules in the
    same pytest process, are not the sandbox's), no process of a run's uid,
    no sandbox cgroup of this process (or of a dead one), no mount in our namespace that was not
    there before, nothing left in the temp dir."""
    tmp = tempfile.mkdtemp(prefix="asyncrl-test-")
    os.chmod(tmp, 0o711)  # the bare back end's runs pass through it to their directories
    monkeypatch.setattr(tempfile, "tempdir", tmp)
    mounts = Path("/proc/self/mountinfo").read_text()
    before = set(children())
    yield Path(tmp)
    try:
        runner.release()
        assert sandbox_processes() == []
        assert sorted(set(children()) - before) == []
        iso = isolation()
        if iso.slots is not None:
            cgroups.remove_stale(iso.slots.hierarchy)  # what the next launcher does at start
            mine = [d for d in cgroups.leftover_slots(iso.slots.hierarchy) if f"-{os.getpid()}-" in d.name]
            assert mine == []
        assert Path("/proc/self/mountinfo").read_text() == mounts
        assert os.listdir(tmp) == []
    finally:
        remove_tree(tmp)


@pytest.fixture
def workdir(nothing_left_behind):
    """A run directory for run_sandboxed called directly."""
    path = Path(tempfile.mkdtemp(dir=nothing_left_behind))
    yield path
    remove_tree(path)
