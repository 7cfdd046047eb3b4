"""Attacks on the code sandbox, each contained (reward 0, or no effect) and checked from outside:
by the host's view of its files, sockets, processes, cgroups and mounts, not by what the program
says. The ones the issue found first: memory across forked children, /dev/shm, a world-writable
shared directory, a world-writable Unix socket, a 3000-deep tree, reading the project, other
runs, Ray's logs and other processes' command lines, and reading an assert test's expected value.

The containment tests run with each back end: the kernel's namespaces, and bubblewrap where it
is installed (where it is not, `isolation("bwrap")` must fall back to the namespaces and say so).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sandbox_support import (LIMITS, ROOT, SLACK_S, limits, nothing_left_behind, py, require_isolation,  # noqa: F401
                             run_python, sandbox_processes, stdio, verifier, workdir)

import asyncrl
from asyncrl.config import CodeRewardConfig
from asyncrl.reward.code_reward import CodeReward
from asyncrl.reward.sandbox import isolation, remove_tree
from asyncrl.reward.sandbox.launcher import remove_stale_staging

BACKENDS = ["namespaces", "bwrap"]
ADD_STDIO = [{"type": "stdio", "input": "1 2\n", "output": "3\n"}]


@pytest.fixture(params=BACKENDS)
def backend(request):
    iso = require_isolation(request.param)
    if request.param == "bwrap" and not iso.bwrap:  # not installed: the namespaces, said so
        assert iso.backend == "namespaces" and any("apt-get install bubblewrap" in m for m in iso.missing)
    return request.param


def test_memory_is_held_for_the_whole_process_tree(backend, workdir):
    """6 forked children touching 400 MiB each: 2.4 GiB against a 256 MiB run."""
    attack = """
        import os, time
        pids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                block = b"x" * (400 << 20)  # written, so resident
                time.sleep(2)
                os._exit(0)
            pids.append(pid)
        print(sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in pids))"""
    result = run_python(attack, workdir, backend, memory_mb=512, wall_time_s=20.0)  # room on a busy machine
    if isolation(backend).slots is None:  # no cgroup (not root): each process is held, not the tree
        assert result.status == "ok" and result.stdout == b"6\n" and result.peak_memory_mb is None
        return
    assert result.status == "memory", result
    assert result.peak_memory_mb <= 512 + 1  # the cgroup's own record, read from outside
    big = CodeReward(CodeRewardConfig(sandbox=limits(backend, memory_mb=512, wall_time_s=20.0)))
    reward, info = big(py(attack), {"tests": stdio("6")})
    assert (reward, info["outcome"]) == (0.0, "memory")


def test_dev_shm_and_tmp_are_private_and_capped(backend, workdir):
    marker = f"asyncrl-shm-{os.getpid()}-{time.time_ns()}"
    attack = f"""
        import os
        for top in ("/dev/shm", "/tmp"):
            written = 0
            try:
                with open(f"{{top}}/{marker}", "wb") as f:
                    while written < 1 << 30:
                        f.write(b"x" * (1 << 20))
                        written += 1 << 20
            except OSError as e:
                pass
            print(top, written >> 20, os.listdir(top))"""
    result = run_python(attack, workdir, backend, wall_time_s=10.0, max_file_mb=2048)
    for top in ("/dev/shm", "/tmp"):
        assert not (Path(top) / marker).exists()  # never on the host
    lines = result.stdout.decode().splitlines()
    if result.status == "ok":  # each tmpfs is capped at memory_mb (256 MiB here)
        assert [line.split()[:2] for line in lines] == [["/dev/shm", "256"], ["/tmp", "256"]], lines
        assert all(line.endswith(f"['{marker}']") for line in lines)  # nothing of the host's there
    else:  # or the run's cgroup stopped it first
        assert result.status == "memory" and isolation(backend).slots is not None


def test_a_shared_world_writable_directory_is_out_of_reach(backend, workdir):
    """A directory like Ray's session directories: mode 0777 without the sticky bit, holding a
    root-owned file. Unprotected, any user may delete the file and leave files of its own."""
    shared = Path("/tmp") / f"asyncrl-shared-{os.getpid()}-{time.time_ns()}"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "owned-by-root").write_text("keep me")
    try:
        attack = f"""
            import os
            for action in (lambda: os.unlink({str(shared / "owned-by-root")!r}),
                           lambda: open({str(shared / "left-behind")!r}, "w").write("x")):
                try:
                    action()
                    print("done")
                except OSError as e:
                    print(type(e).__name__)"""
        result = run_python(attack, workdir, backend)
        assert result.stdout == b"FileNotFoundError\nFileNotFoundError\n"  # not even visible
        assert sorted(p.name for p in shared.iterdir()) == ["owned-by-root"]
        assert (shared / "owned-by-root").read_text() == "keep me"
    finally:
        shutil.rmtree(shared)


def test_a_world_writable_unix_socket_is_out_of_reach(backend, workdir):
    path = f"/tmp/asyncrl-sock-{os.getpid()}-{time.time_ns()}"
    abstract = f"\0asyncrl-sock-{os.getpid()}-{time.time_ns()}"
    listeners = []
    try:
        for address in (path, abstract):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(address)
            listener.listen()
            listener.setblocking(False)
            listeners.append(listener)
        os.chmod(path, 0o777)
        attack = f"""
            import socket
            for address in ({path!r}, {abstract!r}):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(address)
                    s.sendall(b"hello")
                    print("connected")
                except OSError as e:
                    print(type(e).__name__)"""
        result = run_python(attack, workdir, backend)
        assert result.stdout.decode().split() == ["FileNotFoundError", "ConnectionRefusedError"]
        time.sleep(0.1)
        for listener in listeners:
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing ever connected
    finally:
        for listener in listeners:
            listener.close()
        Path(path).unlink(missing_ok=True)


def test_a_3000_deep_tree_costs_nothing_and_leaves_nothing(backend):
    """A correct solution that also builds deep trees where it may write: reward 1 (the clean-up
    once raised RecursionError, and the sample got 0), and nothing is left (nothing_left_behind)."""
    solution = py("""
        import os
        for top in (".", "/tmp", "/dev/shm"):
            fd = os.open(top, os.O_RDONLY)
            for _ in range(3000):
                os.mkdir("d", dir_fd=fd)
                down = os.open("d", os.O_RDONLY, dir_fd=fd)
                os.close(fd)
                fd = down
            os.close(fd)
        print(sum(map(int, input().split())))""")
    reward, info = verifier(backend=backend)(solution, {"tests": ADD_STDIO})
    assert (reward, info["outcome"]) == (1.0, "passed"), info


def test_the_host_is_not_readable(backend, workdir, nothing_left_behind):
    """The project's source, other runs' directories, Ray's logs, other processes' command
    lines and environments: all of it world-readable on the host, none of it there."""
    secret = f"s3cr3t-{os.getpid()}-{time.time_ns()}"
    host = nothing_left_behind / "host"
    runs, ray_logs = host / "runs" / "other-run", host / "ray" / "session_latest" / "logs"
    for d, name in ((runs, "ground_truth.jsonl"), (ray_logs, "worker.out")):
        d.mkdir(parents=True)
        (d / name).write_text(secret)
    for d in [host, *host.rglob("*")]:
        d.chmod(0o755 if d.is_dir() else 0o644)  # world-readable, as runs/ and Ray's logs are
    source = Path(asyncrl.__file__).resolve().parent / "reward" / "code_reward.py"
    holder = subprocess.Popen([secret, "30"], executable="/bin/sleep", env={"SECRET": secret})
    try:
        paths = [str(source), str(source.parents[2]), str(runs / "ground_truth.jsonl"),
                 str(ray_logs / "worker.out"), str(Path.cwd()), "/tmp/ray", f"/proc/{holder.pid}/cmdline",
                 f"/proc/{holder.pid}/environ", f"/proc/{os.getpid()}/environ"]
        attack = f"""
            import os
            for path in {paths!r}:
                try:
                    print(path, "read", open(path, "rb").read()[:200] if os.path.isfile(path) else os.listdir(path))
                except OSError as e:
                    print(path, type(e).__name__)
            for pid in filter(str.isdigit, os.listdir("/proc")):
                print(pid, open(f"/proc/{{pid}}/cmdline", "rb").read())
            print(sorted(os.listdir("/tmp")), os.environ.get("SECRET"))"""
        result = run_python(attack, workdir, backend)
        out = result.stdout.decode()
        assert result.status == "ok", result
        assert secret not in out and "CodeReward" not in out
        assert all(f"{p} FileNotFoundError" in out for p in paths), out
        pids = [line.split()[0] for line in out.splitlines() if line.split()[0].isdigit()]
        assert pids == ["1", "2"]  # its own pid namespace: its init and itself
        assert out.splitlines()[-1] == "[] None"
        reward, _ = verifier(backend=backend)(py(attack), {"tests": stdio(secret)})
        assert reward == 0.0
    finally:
        holder.kill()
        holder.wait()
        remove_tree(host)


def test_assert_tests_do_not_hand_the_expected_value_to_the_solution():
    tests = [{"type": "assert", "code": "assert add(1, 2) == 3\nassert add(20, 22) == 42"}]
    attacks = {
        # read the driver from stdin (a seekable file) and answer with the numbers after ==
        "stdin": """
            import os, re, sys
            os.lseek(0, 0, 0)
            ANSWERS = [int(x) for x in re.findall(r"==\\s*(\\d+)", sys.stdin.read())]
            def add(a, b):
                return ANSWERS.pop(0) if ANSWERS else 0""",
        # look at the caller's code object for the constants of the comparison
        "frames": """
            import sys
            def add(a, b):
                consts = [c for c in sys._getframe(1).f_code.co_consts if isinstance(c, int)]
                return consts[-1] if consts else 0""",
        # an object equal to everything
        "eq": """
            class Anything:
                def __eq__(self, other):
                    return True
            def add(a, b):
                return Anything()""",
        # forge the driver's report: find its nonce and print an empty list of probes, then leave
        "forge": """
            import os, re, sys
            os.lseek(0, 0, 0)
            nonce = re.findall(r"_asyncrl_main\\('([0-9a-f]+)'", sys.stdin.read())[0]
            sys.stdout.write("\\n" + nonce + "[]\\n")
            sys.stdout.flush()
            os._exit(0)""",
    }
    for name, attack in attacks.items():
        reward, info = verifier()(py(attack), {"tests": tests})
        assert (reward, info["outcome"]) == (0.0, "failed"), name
    correct = verifier()(py("def add(a, b):\n    return a + b"), {"tests": tests})
    assert correct[0] == 1.0  # the same test passes a real solution


def test_network_is_isolated(backend):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        attack = py(f"""
            import socket
            socket.create_connection(("127.0.0.1", {port}), timeout=1)
            print("connected")""")
        reward, info = verifier(backend=backend)(attack, {"tests": stdio("connected")})
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    assert (reward, info["outcome"]) == (0.0, "crashed")


def test_it_writes_only_its_own_directory(backend):
    open_dir = Path("/tmp") / f"asyncrl-open-{os.getpid()}-{time.time_ns()}"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # even a world-writable directory
    targets = [open_dir / "pwned", Path.cwd() / "pwned", Path("/usr/pwned"), Path("/pwned")]
    attack = py(f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError as e:
                print(type(e).__name__)
        open("mine", "w").write("fine")  # its own directory: allowed, and gone afterwards
        print(open("mine").read())""")
    try:
        reward, info = verifier(backend=backend)(attack, {"tests": stdio(
            "FileNotFoundError FileNotFoundError OSError OSError fine")})
        assert [t for t in targets if t.exists()] == []
        assert (reward, info["outcome"]) == (1.0, "passed"), info  # each write was refused
    finally:
        shutil.rmtree(open_dir)


def test_the_environment_holds_no_secret(monkeypatch, workdir):
    secret = f"s3cr3t-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", secret)
    result = run_python("import os\nprint(dict(os.environ))", workdir)
    assert result.status == "ok" and b"PATH" in result.stdout and secret.encode() not in result.stdout


def test_a_fork_bomb_is_contained(workdir):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    result = run_python(bomb, workdir)
    assert time.monotonic() - start < LIMITS.wall_time_s + SLACK_S
    assert result.status == "timeout"
    assert sandbox_processes() == []  # every fork died with the run's pid namespace
    reward, info = verifier()(py(bomb), {"tests": ADD_STDIO})
    assert (reward, info["outcome"]) == (0.0, "timeout")


def test_it_cannot_signal_the_host(workdir):
    sentinel = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        attack = f"""
            import os, signal
            for target in (os.getppid(), {sentinel.pid}, {os.getpid()}, 1, -1):
                try:
                    os.kill(target, signal.SIGKILL)
                    print("sent", target)
                except OSError as e:
                    print(type(e).__name__)
            print("survived")"""
        result = run_python(attack, workdir)
        # the host's pids do not exist in its namespace; pid 1 (its init) ignores it; kill(-1)
        # reaches the processes of its own uid it may signal: none but itself, which survives
        assert result.stdout.decode().split()[-1] == "survived", result
        time.sleep(0.1)
        assert sentinel.poll() is None  # alive; and so is this process, which is still running
    finally:
        sentinel.kill()
        sentinel.wait()


def marker_processes(marker):
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                found.append(int(name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("leave_group", [False, True], ids=["child", "setsid-double-fork"])
def test_no_background_process_survives(leave_group):
    marker = f"asyncrl-marker-{os.getpid()}-{time.time_ns()}"
    escape = f"""
        import os, time
        if os.fork() == 0:
            if {leave_group}:
                os.setsid()
                if os.fork() != 0:
                    os._exit(0)
            os.execv("/bin/sleep", [{marker!r}, "100"])
        time.sleep(0.3)  # the background process is running by now
        print(3)"""
    reward, info = verifier()(py(escape), {"tests": stdio("3")})
    assert (reward, info["outcome"]) == (1.0, "passed")  # the solution itself is fine...
    assert marker_processes(marker) == []  # ...but what it left behind is gone


def test_a_worker_killed_outright_takes_its_run_down(nothing_left_behind):
    """The reward pool's last resort is SIGKILL: the launcher sees its caller's socket close and
    kills the run; what the worker could not clean up (its directories, its cgroup) is removed by
    the next one that starts."""
    marker = f"asyncrl-marker-{os.getpid()}-{time.time_ns()}"  # split below: not in the worker's command line
    script = textwrap.dedent(f"""
        from asyncrl.reward.code_reward import CodeReward
        print("started", flush=True)
        CodeReward()("```python\\nimport os\\nos.execv('/bin/sleep', [{marker[:8]!r} + {marker[8:]!r}, '100'])\\n```",
                     {{"tests": [{{"type": "stdio", "input": "", "output": ""}}]}})
        """)
    env = {**os.environ, "PYTHONPATH": str(Path(asyncrl.__file__).parents[1]), "TMPDIR": str(nothing_left_behind)}
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert worker.stdout.readline() == "started\n"
        deadline = time.monotonic() + 20
        while not marker_processes(marker):
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 5
        while marker_processes(marker):
            assert time.monotonic() < deadline, "the run outlived its worker"
            time.sleep(0.05)
    finally:
        worker.kill()
        worker.wait()
    remove_stale_staging(str(nothing_left_behind))  # what the next launcher does at start
    left = sorted(p.name.rsplit("-", 1)[0] for p in nothing_left_behind.iterdir())
    assert left == ["asyncrl-code"]  # the verifier's own directory: its caller's to remove
    for p in nothing_left_behind.iterdir():
        remove_tree(p)


UNPRIVILEGED = """
import json, logging, os, sys, tempfile, types, io
sys.path.insert(0, sys.argv[1])
log = io.StringIO()
logging.basicConfig(stream=log, level=logging.INFO)
from asyncrl.reward.sandbox import isolation, run_sandboxed, runner
iso = isolation()
limits = types.SimpleNamespace(wall_time_s=5.0, cpu_time_s=2, memory_mb=256, max_processes=8, max_file_mb=1,
                               max_output_kb=64, max_open_files=64, backend="auto", syscall_filter=True, cpu_cores=1.0)
workdir = tempfile.mkdtemp()
probe = "import os; print(os.getpid(), os.getuid(), sorted(os.listdir('/tmp')), os.path.exists(sys_argv1))"
result = run_sandboxed(["/usr/bin/python3", "-I", "-S", "-c", probe.replace("sys_argv1", repr(sys.argv[1]))],
                       b"", limits, workdir)
runner.release()
os.rmdir(workdir)
print(json.dumps({"backend": iso.backend, "userns": iso.userns, "layers": iso.layers,
                  "status": result.status, "stdout": result.stdout.decode(), "log": log.getvalue()}))
"""


def test_as_root_every_layer_is_there():
    """The precondition of this file, said once: where CI runs (root, cgroup v1 memory+pids, user
    and mount namespaces) every layer must be there; without root, the ones that need it are not."""
    iso = require_isolation()
    if not ROOT:
        assert not iso.layers["uid"] and not iso.layers["cgroup"] and iso.missing


def test_without_root_the_namespaces_hold_and_the_rest_degrades_loudly():
    """The same machine, as user nobody (or as the user running the tests, when that is not
    root): the namespaces come from a user namespace, the program runs as root of it without
    capabilities; no cgroup and no uid of its own, both logged once."""
    root_dir = str(Path(asyncrl.__file__).resolve().parents[1])
    as_nobody = {"user": 65534, "group": 65534, "extra_groups": []} if ROOT else {}
    out = subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", UNPRIVILEGED, root_dir], capture_output=True,
                         text=True, cwd="/", timeout=60, env={"PATH": "/usr/bin:/bin"}, **as_nobody)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["backend"], report["userns"], report["status"]) == ("namespaces", True, "ok"), report
    assert report["layers"] == {"filesystem": True, "pid": True, "network": True, "ipc": True,
                                "uid": False, "cgroup": False, "cpu": False, "syscalls": True}
    pid, uid, tmp, sees_project = report["stdout"].split(" ", 3)
    assert (pid, uid, tmp, sees_project.strip()) == ("2", "0", "[]", "False")
    assert report["log"].count("code sandbox:") == 1  # once, at the first run
    assert "missing: cgroup (needs root)" in report["log"] and "missing: uid of its own" in report["log"]
