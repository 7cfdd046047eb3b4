"""Attacks on what the sandbox shares with the runs before and after it and with the machine:
memory parked past a run's end, the verifier's own CPU, host-wide kernel budgets (AIO, open
files, core dumps, keyrings), inotify on the shared /usr, the number of tests a sample ran, and a
tolerance that let a wrong integer pass. Each test here failed on the code before its fix (run
in a clone of it); each is checked from outside the run: by the run after it, the verifier's
CPU clock, the host's /proc, the verdict."""

import errno
import os
import threading
import time
from pathlib import Path

import pytest
from sandbox_support import (ROOT, limits, nothing_left_behind, our_uids, py, require_isolation,  # noqa: F401
                             run_python, verifier, workdir)

from asyncrl.config import CodeRewardConfig
from asyncrl.reward.code_reward import CodeReward
from asyncrl.reward.fault_injection import ORDINARY, memory_cycle
from asyncrl.reward.sandbox import runner

BIG = dict(memory_mb=512, wall_time_s=20.0)  # room for the attack on a busy machine


@pytest.mark.skipif(not ROOT, reason="needs root: the memory of a run is a cgroup's only as root")
def test_memory_parked_past_a_run_is_not_charged_to_the_next(workdir):
    """496 MiB of memory files sent over a socket with both its ends and closed: only the kernel's
    Unix-socket collector frees them, 0.1-2 s later, and until then they were charged to the
    launcher's cgroup, so the next run on it (64 MiB and `print(3)`) failed as memory. The
    launcher lives on: collected in time, nothing had to be replaced. Through the reward pool:
    test_reward_pool.py."""
    iso = require_isolation()
    launchers = set()
    for _ in range(3):
        attack = run_python(memory_cycle(496), workdir, **BIG)
        assert attack.status == "ok" and attack.stdout == b"parked\n", attack
        honest = run_python(ORDINARY, workdir, **BIG)
        assert (honest.status, honest.stdout) == ("ok", b"3\n"), honest
        launchers |= {launcher.proc.pid for launcher in runner._pool(iso)._all}
    assert len(launchers) == 1  # one run at a time: one launcher, the same all along


@pytest.mark.skipif(not ROOT, reason="needs root: the memory of a run is a cgroup's only as root")
def test_no_run_can_get_its_launcher_oom_killed(workdir, monkeypatch):
    """The launcher stays in the caller's cgroup and each run joins its slot: between runs the
    slot holds no process, so memory parked there can make the kernel's OOM killer take a run, never
    the launcher. It used to live in its slot, where with a slot full of parked memory its own next
    allocation could get it killed (the root launcher died so in several runs through the pool).
    Here the slot is left full on purpose (no settling): the runs after the attack pay for it (an
    OOM kill, outcome memory), and the launcher lives on."""
    iso = require_isolation()
    monkeypatch.setattr(runner, "SETTLED_MB", 1 << 20)  # never renew the slot: the parked memory stays
    first = run_python(ORDINARY, workdir, **BIG)
    assert (first.status, first.stdout) == ("ok", b"3\n") and first.peak_memory_mb >= 64, first  # charged to the slot
    (launcher,) = runner._pool(iso)._all
    slot = launcher.slot
    assert _memory_cgroup(launcher.proc.pid) == _memory_cgroup(os.getpid())  # the caller's, not the slot below it
    assert slot.pids() == []
    attack = run_python(memory_cycle(496), workdir, **BIG)
    assert attack.status == "ok" and attack.stdout == b"parked\n", attack
    for _ in range(3):
        after = run_python(ORDINARY, workdir, **BIG)
        assert after.status in ("ok", "memory"), after  # "memory" while the kernel has not collected
        assert slot.pids() == []
    assert [launcher.proc.pid] == [launcher.proc.pid for launcher in runner._pool(iso)._all]
    assert launcher.proc.poll() is None and launcher.slot is slot


@pytest.mark.skipif(not ROOT, reason="needs root: the memory of a run is a cgroup's only as root")
def test_a_slot_that_does_not_empty_is_replaced_under_the_same_launcher(workdir, monkeypatch):
    """When what a run left is not freed in time its slot is removed and the launcher gets a fresh
    one (it is in no slot, so it need not be replaced with it); here no slot ever counts as
    settled, so every run renews it."""
    iso = require_isolation()
    monkeypatch.setattr(runner, "SETTLED_MB", -1)
    monkeypatch.setattr(runner, "SETTLE_S", 0.0)
    slots, pids = [], set()
    for program in (memory_cycle(496), ORDINARY, ORDINARY):
        result = run_python(program, workdir, **BIG)
        assert result.status == "ok" and result.stdout in (b"parked\n", b"3\n"), result
        (launcher,) = runner._pool(iso)._all
        slots.append(launcher.slot)
        pids.add(launcher.proc.pid)
    assert len(pids) == 1 and len({id(slot) for slot in slots}) == 3
    assert [slot.dirs["memory"].exists() for slot in slots] == [False, False, True]


def _memory_cgroup(pid: int) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path(path)
    raise AssertionError(f"no memory cgroup for {pid}")


P = 2**61 - 1  # Python hashes an int as the int modulo P


def test_a_report_built_to_collide_costs_the_verifier_little():
    """A call returns a set subclass that iterates as 40,000 ints that all hash alike (the set
    itself is empty: the run takes 0.04 s): decoding it made the verifier build a set by
    quadratic probing, 6 CPU-s per test outside every limit."""
    flood = f"""
        class Bag(set):
            def __iter__(self):
                return (k * {P} for k in range(1, 40001))
        def f():
            return Bag()"""
    test = [{"type": "call", "fn": "f", "args": [], "expected": [1]}]
    big_output = CodeReward(CodeRewardConfig(sandbox=limits(max_output_kb=2048, wall_time_s=5.0)))
    cpu = time.process_time()
    reward, info = big_output(py(flood), {"tests": test})
    assert time.process_time() - cpu < 1.0  # the verifier's own CPU (it runs in this process)
    assert (reward, info["outcome"]) == (0.0, "verifier_limit")
    plain = "def f():\n    return set(range(1, 40001))"  # as large, without collisions: decoded and compared
    assert big_output(py(plain), {"tests": test})[1]["outcome"] == "failed"


def test_aio_and_inotify_are_refused(workdir):
    """io_setup(65536) took the machine's whole fs.aio-max-nr (io_setup(1) failed everywhere else
    while the run held it), and an inotify watch on the shared /usr showed a run what a
    concurrent one opened."""
    require_isolation()
    attack = """
        import ctypes, os, time
        libc = ctypes.CDLL(None, use_errno=True)
        ctx = ctypes.c_ulong(0)
        print(libc.syscall(206 if os.uname().machine == "x86_64" else 0, 65536, ctypes.byref(ctx)), ctypes.get_errno())
        print(libc.inotify_init1(0), ctypes.get_errno())
        print(libc.fanotify_init(0, 0), ctypes.get_errno())
        time.sleep(1.0)"""
    aio_nr = Path("/proc/sys/fs/aio-nr")
    before, seen = int(aio_nr.read_text()), []
    sampler = threading.Thread(target=lambda: (time.sleep(0.6), seen.append(int(aio_nr.read_text()))))
    sampler.start()
    result = run_python(attack, workdir, wall_time_s=5.0)
    sampler.join()
    assert result.status == "ok", result
    assert result.stdout.decode().split("\n")[:3] == [f"-1 {errno.EPERM}"] * 3
    assert seen[0] - before < 65536  # nothing of the machine's AIO budget was taken


def test_open_files_are_capped(workdir):
    """No RLIMIT_NOFILE: one run could hold 12% of the machine's fs.file-max."""
    require_isolation()
    attack = """
        import os, resource
        n = 0
        try:
            while True:
                os.open("/dev/null", os.O_RDONLY)
                n += 1
        except OSError as e:
            print(n, e.errno, resource.getrlimit(resource.RLIMIT_NOFILE))"""
    result = run_python(attack, workdir, max_open_files=64)
    count, code, limit = result.stdout.decode().split(" ", 2)
    assert int(count) < 64 and int(code) == errno.EMFILE and limit.strip() == "(64, 64)", result


def test_core_dumps_are_off_even_for_a_piping_core_pattern(workdir):
    """RLIMIT_CORE 0 does not stop a core_pattern that pipes to a helper (the kernel starts it for
    every crash); a limit of exactly 1 does, and a file core needs more than 1 byte."""
    require_isolation()
    result = run_python("import resource; print(resource.getrlimit(resource.RLIMIT_CORE))", workdir)
    assert result.stdout == b"(1, 1)\n", result


def key_users() -> dict[int, str]:
    """uid -> its line in /proc/key-users (a uid is listed while it owns any key or keyring)."""
    lines = Path("/proc/key-users").read_text().splitlines()
    return {int(line.split(":")[0]): line for line in lines}


@pytest.mark.skipif(not ROOT, reason="needs root: a uid of its own per run")
@pytest.mark.parametrize("syscall_filter", [True, False])
def test_a_run_leaves_no_keyring_in_the_kernel(workdir, syscall_filter):
    """Clearing a uid's keyrings after a run without the filter created them: two keyrings per uid
    that the kernel keeps for good, for every run and probe uid."""
    require_isolation()
    ours = set(our_uids())
    before = {u for u in key_users() if u in ours}
    for _ in range(3):
        assert run_python("print(1)", workdir, syscall_filter=syscall_filter).stdout == b"1\n"
    time.sleep(0.2)  # a session keyring that died with its run is collected asynchronously
    assert {u for u in key_users() if u in ours} - before == set()


def test_every_test_runs_after_a_wrong_answer():
    """all_pass stopped at the first wrong answer, so the number of tests a sample ran (which a
    later sample can read through the page cache they share) told it which answers were right.
    A run that crashes or times out still ends the sample: the program knew that already."""
    tests = [{"type": "stdio", "input": str(n), "output": str(n)} for n in range(4)]
    wrong_first = py("n = int(input())\nprint(n if n else 9)")
    reward, info = verifier()(wrong_first, {"tests": tests})
    assert (reward, info["outcome"], info["tests_run"], info["tests_passed"]) == (0.0, "failed", 4, 3)
    crash_first = py("n = int(input())\nassert n\nprint(n)")
    reward, info = verifier()(crash_first, {"tests": tests})
    assert (reward, info["outcome"], info["tests_run"]) == (0.0, "crashed", 1)


@pytest.mark.parametrize("program, expected", [
    ("print(10 ** 9)", "1000000007"),  # within 1e-6 of it, relatively
    ("print(1000000008)", "1000000007"),
])
def test_a_wrong_integer_fails_whatever_the_tolerance(program, expected):
    """float_tolerance was relative and applied to integers: 10**9 passed for 1000000007."""
    stdio = [{"type": "stdio", "input": "", "output": expected}]
    assert verifier(float_tolerance=1e-6)(py(program), {"tests": stdio})[1]["outcome"] == "failed"
    call = [{"type": "call", "fn": "f", "args": [], "expected": int(expected)}]
    returned = program.replace("print(", "def f():\n    return (")
    assert verifier(float_tolerance=1e-6)(py(returned), {"tests": call})[1]["outcome"] == "failed"
    real = [{"type": "stdio", "input": "", "output": "2.5"}]  # a real number keeps its tolerance
    assert verifier(float_tolerance=1e-6)(py("print(2.5000001)"), {"tests": real})[0] == 1.0
