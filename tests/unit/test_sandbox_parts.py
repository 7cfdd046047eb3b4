"""The sandbox's parts that need no process: iterative clean-up, finding cgroups (v1 and v2, from
fake /proc files), a v2 slot's limits and counters on a fake cgroup directory, the root layout and
its bubblewrap form. The real thing runs in tests/integration/test_sandbox*.py."""

import os
import sys

import pytest

from asyncrl.reward.sandbox import cgroups, remove_tree, rootfs


def deep_tree(top, depth, name="d"):
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        down = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = down
    return fd


def test_remove_tree_takes_a_3000_deep_tree_that_rmtree_cannot(tmp_path):
    (tmp_path / "t").mkdir()
    os.close(deep_tree(tmp_path / "t", 3000))  # paths past PATH_MAX, nesting past the recursion limit
    remove_tree(tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_remove_tree_gives_itself_permissions_and_never_follows_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    (tree / "link").symlink_to(outside)
    (tree / "a" / "filelink").symlink_to(outside / "keep")
    for _ in range(200):
        (tree / f"wide{_}").mkdir()
    (tree / "a" / "b").chmod(0o000)
    (tree / "a").chmod(0o000)
    remove_tree(tree)
    assert not tree.exists() and (outside / "keep").read_text() == "x"
    remove_tree(tree)  # gone already: no error
    (tmp_path / "file").write_text("x")
    remove_tree(tmp_path / "file")
    assert not (tmp_path / "file").exists()


def fake_proc(tmp_path, cgroup, mountinfo):
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(mountinfo)
    return tmp_path


MOUNT = "31 23 0:28 / {point} rw,relatime - {fstype} cgroup rw,{opts}\n"


def test_find_reads_v1_and_v2_hierarchies(tmp_path):
    v1 = fake_proc(tmp_path, "4:memory:/job/a\n8:pids:/\n0::/\n",
                   MOUNT.format(point="/sys/fs/cgroup/memory", fstype="cgroup", opts="memory")
                   + MOUNT.format(point="/sys/fs/cgroup/pids", fstype="cgroup", opts="pids"))
    assert cgroups.find(v1) == cgroups.Hierarchy(1, {"memory": cgroups.Path("/sys/fs/cgroup/memory/job/a"),
                                                     "pids": cgroups.Path("/sys/fs/cgroup/pids")})
    # cpu and cpuacct (as these machines mount them, apart): the quota and the account, or neither
    cpu_mounts = (MOUNT.format(point="/sys/fs/cgroup/cpu", fstype="cgroup", opts="cpu")
                  + MOUNT.format(point="/sys/fs/cgroup/cpuacct", fstype="cgroup", opts="cpuacct"))
    v1_cpu = fake_proc(tmp_path, "4:memory:/job/a\n8:pids:/\n1:cpu:/\n2:cpuacct:/\n0::/\n",
                       MOUNT.format(point="/sys/fs/cgroup/memory", fstype="cgroup", opts="memory")
                       + MOUNT.format(point="/sys/fs/cgroup/pids", fstype="cgroup", opts="pids") + cpu_mounts)
    assert cgroups.find(v1_cpu).dirs == {"memory": cgroups.Path("/sys/fs/cgroup/memory/job/a"),
                                         "pids": cgroups.Path("/sys/fs/cgroup/pids"),
                                         "cpu": cgroups.Path("/sys/fs/cgroup/cpu"),
                                         "cpuacct": cgroups.Path("/sys/fs/cgroup/cpuacct")}
    v1_no_account = fake_proc(tmp_path, "4:memory:/job/a\n8:pids:/\n1:cpu:/\n0::/\n",
                              MOUNT.format(point="/sys/fs/cgroup/memory", fstype="cgroup", opts="memory")
                              + MOUNT.format(point="/sys/fs/cgroup/pids", fstype="cgroup", opts="pids")
                              + MOUNT.format(point="/sys/fs/cgroup/cpu", fstype="cgroup", opts="cpu"))
    assert set(cgroups.find(v1_no_account).dirs) == {"memory", "pids"}
    unified = tmp_path / "unified"
    (unified / "user.slice").mkdir(parents=True)
    (unified / "user.slice" / "cgroup.controllers").write_text("cpu memory pids\n")
    v2 = fake_proc(tmp_path, "0::/user.slice\n", MOUNT.format(point=unified, fstype="cgroup2", opts="nsdelegate"))
    d = unified / "user.slice"
    assert cgroups.find(v2) == cgroups.Hierarchy(2, {"memory": d, "pids": d, "cpu": d})
    (d / "cgroup.controllers").write_text("memory pids\n")
    assert cgroups.find(v2) == cgroups.Hierarchy(2, {"memory": d, "pids": d})
    (unified / "user.slice" / "cgroup.controllers").write_text("cpu io\n")
    assert cgroups.find(v2) is None  # no memory or pids controller to use


def test_a_v2_slot_sets_limits_and_reads_counters(tmp_path):
    d = tmp_path / "asyncrl-sandbox-1-1"
    d.mkdir()
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    (d / "memory.swap.max").write_text("max\n")
    (d / "cgroup.procs").write_text("")
    slot = cgroups.Slot(2, {"memory": d, "pids": d})
    slot.prepare(256, 19)
    assert ((d / "memory.max").read_text(), (d / "pids.max").read_text(), (d / "memory.swap.max").read_text()) == (
        str(256 << 20), "19", "0")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 4\noom_kill 5\n")
    assert slot.usage() == (None, 3)  # no memory.peak here; OOM kills since prepare()
    assert slot.procs_files == slot.join_files == [bytes(d / "cgroup.procs")]


def test_a_slot_holds_the_trees_cpu(tmp_path):
    """v2: cpu.max is the quota (cores x period), cpu.stat's usage_usec the account since prepare();
    v1: cpu.cfs_quota_us and cpuacct.usage (ns)."""
    d = tmp_path / "asyncrl-sandbox-1-2"
    d.mkdir()
    for name, text in (("memory.events", "oom_kill 0\n"), ("cgroup.procs", ""), ("cpu.stat", "usage_usec 2500000\n")):
        (d / name).write_text(text)
    slot = cgroups.Slot(2, {"memory": d, "pids": d, "cpu": d})
    slot.prepare(256, 19, cpu_cores=0.5)
    assert (d / "cpu.max").read_text() == "50000 100000"
    (d / "cpu.stat").write_text("usage_usec 3750000\nuser_usec 1\n")
    assert slot.cpu_s() == pytest.approx(1.25)
    slot.prepare(256, 19, cpu_cores=0.0)  # no quota
    assert (d / "cpu.max").read_text() == "max 100000" and slot.cpu_s() == 0.0
    mem, cpu, acct = (tmp_path / n for n in ("m", "c", "a"))
    for p in (mem, cpu, acct):
        p.mkdir()
    (mem / "memory.oom_control").write_text("oom_kill 0\n")
    (acct / "cpuacct.usage").write_text("7000000000\n")
    v1 = cgroups.Slot(1, {"memory": mem, "pids": mem, "cpu": cpu, "cpuacct": acct})
    v1.prepare(256, 19, cpu_cores=2.0)
    assert ((cpu / "cpu.cfs_quota_us").read_text(), (cpu / "cpu.cfs_period_us").read_text()) == ("200000", "100000")
    (acct / "cpuacct.usage").write_text("7300000000\n")
    assert v1.cpu_s() == pytest.approx(0.3)
    # a run joins with its one thread (`tasks`: no global lock), once per hierarchy
    assert v1.join_files == sorted(bytes(p / "tasks") for p in (mem, cpu, acct))
    assert cgroups.Slot(2, {"memory": d, "pids": d}).cpu_s() is None  # no cpu controller: not counted


def test_layout_binds_system_dirs_and_an_interpreter_outside_them():
    steps = rootfs.layout((sys.executable, "/usr/bin/g++", "./solution"))
    kinds = {step[-1]: step[0] for step in steps}
    for d in ("/usr", "/bin", "/lib", "/lib64", "/sbin"):
        if os.path.exists(d):
            assert kinds[d] == ("symlink" if os.path.islink(d) else "ro")
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    assert kinds[prefix] == ("ro" if not prefix.startswith("/usr/") else kinds[prefix])
    assert [d for d in ("/tmp", "/dev/shm", "/proc", "/sandbox") if kinds[d] != "dir"] == []
    assert not any(step[0] == "ro" and step[1].startswith(("/work", "/tmp", "/home", "/root/")) and
                   step[1] != prefix for step in steps)


def test_bwrap_args_give_the_same_view():
    steps = (("symlink", "usr/bin", "/bin"), ("ro", "/usr", "/usr"), ("dir", "/etc"),
             ("ro", "/etc/ld.so.cache", "/etc/ld.so.cache"), ("dir", "/dev"), ("tmpfs", "/dev", 1 << 20, 0o755),
             ("dev", "/dev/null"), ("symlink", "/proc/self/fd", "/dev/fd"), ("dir", "/tmp"), ("dir", "/dev/shm"),
             ("dir", "/proc"), ("dir", "/sandbox"))
    args = rootfs.bwrap_args(steps, [(7, "solution.py", 0o100644)], None, 64)
    text = " ".join(args)
    assert "--unshare-all" in args and "--die-with-parent" in args and "--share-net" not in args
    assert "--symlink usr/bin /bin --ro-bind /usr /usr" in text and "--dev /dev" in text
    assert "/dev/null" not in text  # bubblewrap's --dev makes the devices
    assert f"--size {64 << 20} --tmpfs /tmp" in text and f"--size {64 << 20} --tmpfs /dev/shm" in text
    assert "--perms 644 --file 7 /sandbox/solution.py" in text and text.endswith("--remount-ro / --chdir /sandbox --")
    persist = " ".join(rootfs.bwrap_args(steps, [], 9, 64))
    assert "--bind-fd 9 /sandbox" in persist and "--file" not in persist
