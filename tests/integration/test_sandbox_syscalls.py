"""Attacks through system calls and through the report, each run from inside the sandbox and
checked from outside (the host's keyrings, vsock ports and /proc, the launcher's process, the
verifier's result), with each back end. Before the system-call filter (asyncrl/reward/sandbox/
seccomp.py), a network namespace per run and a verifier that takes its report as untrusted, each
of these got through: keyrings are not namespaced, vsock is not covered by the network
namespace, a self-traced program killed its launcher, an abstract socket outlived its run, and a
crafted report made the verifier raise (a verifier error, which stops a run)."""

import ctypes
import errno
import os
import socket
import threading
import time

import pytest
from sandbox_support import (ROOT, nothing_left_behind, py, require_isolation, run_python, verifier,  # noqa: F401
                             workdir)

from asyncrl.reward.sandbox import isolation, runner

libc = ctypes.CDLL(None, use_errno=True)
KEYCTL_UNLINK, KEYCTL_READ = 9, 11
SESSION, USER = -3, -4
NR = {"x86_64": {"add_key": 248, "keyctl": 250}, "aarch64": {"add_key": 217, "keyctl": 219}}[os.uname().machine]
# what the program tries: read the caller's session keyring, add to it and to its uid's keyring
KEYRING_ATTACK = f"""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def call(nr, *args):
        r = libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
        return r if r >= 0 else -ctypes.get_errno()
    buf = ctypes.create_string_buffer(4096)
    print("read", call({NR['keyctl']}, {KEYCTL_READ}, {SESSION}, buf, 4096))
    for ring in ({SESSION}, {USER}):
        print("add", call({NR['add_key']}, b"user", b"asyncrl-planted", b"for the next run", 16, ring))"""
BACKENDS = ["namespaces", "bwrap"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return require_isolation(request.param).backend


def keyctl(*args):
    r = libc.syscall(NR["keyctl"], *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return r if r >= 0 else -ctypes.get_errno()


def keys_in(keyring: int) -> list[int]:
    """The key ids a keyring of this process holds."""
    buf = ctypes.create_string_buffer(4096)
    n = keyctl(KEYCTL_READ, keyring, buf, 4096)
    assert n >= 0, f"keyctl read: {os.strerror(-n)}"
    return list(memoryview(buf.raw[:n]).cast("i"))


def user_keyring_of(uid: int) -> list[int]:
    """The keys in `uid`'s user keyring, read by a child that becomes it (the keyring is per uid)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.write(w, repr(keys_in(USER)).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return eval(f.read())  # a list of ints, written by our own child


@pytest.mark.skipif(not ROOT, reason="needs root: a uid of its own per run, and a user keyring to look at")
@pytest.mark.parametrize("syscall_filter", [True, False])
def test_keyrings_are_out_of_reach(backend, workdir, syscall_filter):
    """With the filter every keyring call is refused; without it (a kernel that takes none, or
    syscall_filter off) the program gets a fresh empty session keyring, and what it adds to its
    uid's keyring (which outlives it) is cleared after the run."""
    secret = libc.syscall(NR["add_key"], b"user", b"asyncrl-trainer-secret", b"hunter2", 7, ctypes.c_long(SESSION))
    assert secret > 0
    try:
        before = keys_in(SESSION)
        result = run_python(KEYRING_ATTACK, workdir, backend, syscall_filter=syscall_filter)
        assert result.status == "ok", result
        read, *adds = result.stdout.decode().split("\n")[:3]
        if syscall_filter:
            assert [read, *adds] == [f"read {-errno.EPERM}"] + [f"add {-errno.EPERM}"] * 2
        else:
            assert read == "read 0" and all(int(a.split()[1]) > 0 for a in adds), (read, adds)
        assert keys_in(SESSION) == before  # nothing added to, or removed from, the caller's
        assert user_keyring_of(result.uid) == []  # nothing left for the next run with this uid
    finally:
        keyctl(KEYCTL_UNLINK, secret, SESSION)


def test_vsock_is_refused(backend, workdir):
    """Inside a VM the vsock port space is the host's: a program that binds a port holds it
    against everyone (seen from outside: the host cannot bind it while the program runs)."""
    port = 40000 + os.getpid() % 20000
    attack = f"""
        import socket, time
        try:
            s = socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK
            s.bind((0xFFFFFFFF, {port}))
            s.listen()
            print("bound", flush=True)
        except OSError as e:
            print("refused", e.errno, flush=True)
        time.sleep(1.5)"""
    seen = {}

    def try_bind_from_outside():
        time.sleep(0.7)  # the program has bound by now, if it can
        try:
            with socket.socket(40, socket.SOCK_STREAM) as s:
                s.bind((0xFFFFFFFF, port))
            seen["host"] = "bound"
        except OSError as e:
            seen["host"] = e.errno

    probe = threading.Thread(target=try_bind_from_outside)
    probe.start()
    result = run_python(attack, workdir, backend, wall_time_s=5.0)
    probe.join()
    assert result.stdout.decode().split() == ["refused", str(errno.EAFNOSUPPORT)], result
    assert seen["host"] in ("bound", errno.EAFNOSUPPORT)  # EAFNOSUPPORT: no vsock on this host at all


@pytest.mark.parametrize("syscall_filter", [True, False])
def test_a_program_that_traces_itself_leaves_its_launcher_alive(backend, workdir, syscall_filter):
    """PTRACE_TRACEME and a SIGSTOP to itself: the init, its tracer, saw a stop and took it for the
    program's end, and the launcher died decoding it (a root traceback on the trainer's console).
    With the filter ptrace is refused (the program stops until the wall clock); without it the
    init kills a program that stops."""
    attack = """
        import ctypes, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        print("traceme", libc.ptrace(0, 0, None, None), ctypes.get_errno(), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        print("went on")"""
    run_python("print(1)", workdir, backend)
    iso = isolation(backend)
    launcher = runner._pools[iso]._free[0]
    result = run_python(attack, workdir, backend, wall_time_s=1.0, syscall_filter=syscall_filter)
    if syscall_filter:
        assert result.stdout.decode().split("\n")[0] == f"traceme -1 {errno.EPERM}", result
        assert result.status == "timeout", result
    else:
        assert result.stdout.decode().split("\n")[0] == "traceme 0 0", result
        assert result.status == "killed" and result.wall_s < 0.9, result
    assert launcher.proc.poll() is None  # the same launcher, alive, runs the next program
    after = run_python("print(2)", workdir, backend)
    assert (after.status, after.stdout) == ("ok", b"2\n") and runner._pools[iso]._free == [launcher]


def test_an_abstract_socket_does_not_outlive_its_run(backend, workdir):
    """A listening abstract socket kept alive past the program's end by a descriptor cycle (its own
    fd in flight on itself over SCM_RIGHTS, freed only by the kernel's garbage collector) must not
    be reachable by the next run of the same launcher, nor be in the launcher's namespace."""
    name = f"asyncrl-left-{os.getpid()}-{time.time_ns()}"
    plant = f"""
        import array, socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\\0{name}")
        s.listen()
        a, b = socket.socketpair()
        fds = array.array("i", [s.fileno(), a.fileno(), b.fileno()])
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        b.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        print("planted")"""
    meet = f"""
        import socket
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            c.connect("\\0{name}")
            print("met")
        except OSError as e:
            print("alone", e.errno)"""
    first = run_python(plant, workdir, backend)
    assert (first.status, first.stdout) == ("ok", b"planted\n"), first
    second = run_python(meet, workdir, backend)
    assert second.stdout.decode().split()[0] == "alone", second
    launcher = runner._pools[isolation(backend)]._free[0]  # the same launcher ran both
    with open(f"/proc/{launcher.proc.pid}/net/unix") as f:  # its network namespace now
        assert name not in f.read()


def test_a_crafted_report_is_a_failed_test_not_a_verifier_error():
    """Untrusted output: a 400-digit number against a float within a tolerance (OverflowError),
    and a forged assert report that is a number where the driver writes a list (TypeError). Each
    was a verifier error, and one in the first hundred samples stopped a run."""
    huge = verifier(float_tolerance=1e-6)(py("def f(x):\n    return 10 ** 400"),
                                          {"tests": [{"type": "call", "fn": "f", "args": [1], "expected": 2.5}]})
    assert (huge[0], huge[1]["outcome"]) == (0.0, "failed")
    scalar = """
        import os, re, sys
        os.lseek(0, 0, 0)
        nonce = re.findall(r"_asyncrl_main\\('([0-9a-f]+)'", sys.stdin.read())[0]
        sys.stdout.write("\\n" + nonce + "7\\n")
        sys.stdout.flush()
        os._exit(0)"""
    forged = verifier()(py(scalar), {"tests": [{"type": "assert", "code": "assert f(1) == 2"}]})
    assert (forged[0], forged[1]["outcome"]) == (0.0, "failed")
    right = verifier(float_tolerance=1e-6)(py("def f(x):\n    return 2.5000001"),
                                           {"tests": [{"type": "call", "fn": "f", "args": [1], "expected": 2.5}]})
    assert right[0] == 1.0


def test_a_fault_of_the_launcher_is_a_result_not_a_traceback(capfd, workdir):
    """Whatever breaks inside the launcher (a root process) reaches the caller as the reason a run
    could not start or went wrong (sandbox_error), and nothing lands on the trainer's console."""
    iso = require_isolation()
    pool = runner._pool(iso)
    launcher = pool.acquire()
    r, w = os.pipe()
    try:
        why = launcher.start({"argv": ["/bin/true"]}, [r, w, w])  # a request without its other fields
    finally:
        os.close(r)
        os.close(w)
    assert why is not None and b"KeyError" in why
    assert launcher.proc.wait(5) == 0  # it ended on its own, cleanly
    pool.discard(launcher)
    assert "Traceback" not in capfd.readouterr().err
    after = run_python("print(3)", workdir)  # a new launcher takes its place
    assert (after.status, after.stdout) == ("ok", b"3\n")


def test_the_launcher_writes_no_bytecode_into_the_checkout(monkeypatch, workdir):
    """The launcher runs `python -I` (which ignores PYTHONDONTWRITEBYTECODE): without -B it wrote
    __pycache__ directories into the package it imports, the user's checkout."""
    import shutil
    import tempfile
    from pathlib import Path

    from asyncrl.reward.sandbox import launcher as launcher_module

    package = Path(tempfile.mkdtemp(prefix="asyncrl-checkout-", dir="/var/tmp"))  # outside the test's temp dir
    try:
        shutil.copytree(launcher_module.ROOT_DIR / "asyncrl", package / "asyncrl",
                        ignore=shutil.ignore_patterns("__pycache__"))
        runner.release()  # launchers start fresh, from the copy
        monkeypatch.setattr(launcher_module, "ROOT_DIR", package)
        result = run_python("print(4)", workdir)
        assert (result.status, result.stdout) == ("ok", b"4\n")
        runner.release()
        assert sorted(str(p.relative_to(package)) for p in package.rglob("__pycache__")) == []
    finally:
        shutil.rmtree(package)


@pytest.mark.skipif(not ROOT, reason="needs root: a cgroup per launcher")
def test_cpu_is_held_for_the_whole_tree(workdir):
    """Busy children, each in a session of its own: RLIMIT_CPU holds each process, not the run (15
    of them used 7.5 CPU-seconds against a limit of 5, and 1.2-1.6 of 2 cores). The run's cgroup
    holds the tree to cpu_cores, and its total CPU time to cpu_time_s (a timeout)."""
    iso = require_isolation()
    attack = """
        import os
        for _ in range(6):
            if os.fork() == 0:
                os.setsid()
                break
        while True:
            pass"""
    result = run_python(attack, workdir, cpu_time_s=1, wall_time_s=10.0, cpu_cores=1.0, max_processes=16)
    slot = runner._pools[iso]._free[0].slot
    assert slot.has_cpu
    assert result.status == "timeout", result
    assert result.wall_s < 2.5, result  # one core's worth: about 1 s of wall for 1 s of CPU
    assert slot.cpu_s() < 1.0 + 0.3  # read from outside: the tree's whole CPU time

    # under the limit, a share of a core: 4 busy processes for 1.2 s hold 0.5 of a core
    share = """
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                break
        end = time.monotonic() + 1.2
        while time.monotonic() < end:
            pass"""
    result = run_python(share, workdir, cpu_time_s=5, wall_time_s=10.0, cpu_cores=0.5, max_processes=16)
    assert result.status == "ok", result
    assert slot.cpu_s() < 0.5 * result.wall_s + 0.2, (slot.cpu_s(), result.wall_s)
