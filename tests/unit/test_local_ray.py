"""The reaper of a driver's own Ray cluster (asyncrl/local_ray.py), on stand-in processes: a
"raylet" whose children ignore SIGTERM, as the raylet's agents do while they wait on a dead GCS
(a reaper that only sent them SIGTERM would leave them running).
tests/e2e/test_no_process_outlives.py checks it on a real run's cluster."""

import os
import signal
import subprocess
import sys
import time

from asyncrl import local_ray

# A parent that starts two children ignoring SIGTERM, prints their pids, then waits.
RAYLET = """
import signal, subprocess, sys, time
kids = [subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 600"]) for _ in range(2)]
print(*[k.pid for k in kids], flush=True)
time.sleep(600)
"""


def start_raylet():
    raylet = subprocess.Popen([sys.executable, "-c", RAYLET], stdout=subprocess.PIPE, text=True)
    kids = [int(p) for p in raylet.stdout.readline().split()]
    time.sleep(0.2)  # the children ignore SIGTERM by now
    return raylet, kids


def gone(pid):
    return local_ray._stat(pid) == (0, b"")


def test_a_killed_raylets_children_that_ignore_sigterm_are_killed_and_nothing_else():
    raylet, kids = start_raylet()
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        noted = local_ray.children({raylet.pid: local_ray._stat(raylet.pid)[1]})
        assert sorted(noted) == sorted(kids)
        raylet.kill()
        raylet.wait()
        killed = local_ray.reap(noted, {raylet.pid: b"gone"}, grace_s=0.5)
        assert sorted(killed) == sorted(kids)  # still there after the grace: SIGKILL, which no process can ignore
        time.sleep(0.3)
        assert all(gone(pid) for pid in kids) and not gone(bystander.pid)
    finally:
        for pid in kids:
            local_ray._signal(pid, signal.SIGKILL)
        bystander.kill()
        raylet.kill()


def test_a_process_whose_pid_was_given_again_is_left_alone():
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        started = local_ray._stat(bystander.pid)[1]
        assert local_ray.reap({bystander.pid: b"0" + started}, {}, grace_s=0.2) == []
        assert not gone(bystander.pid)
    finally:
        bystander.kill()


def test_the_reaper_acts_when_the_pipes_writer_ends_and_not_before():
    raylet, kids = start_raylet()
    read, write = os.pipe()
    reaper = subprocess.Popen([sys.executable, "-m", "asyncrl.local_ray", str(raylet.pid)], stdin=read)
    os.close(read)
    try:
        time.sleep(2 * local_ray.SNAPSHOT_S)  # it notes the children while the writer lives
        assert reaper.poll() is None and not any(gone(pid) for pid in kids)
        os.close(write)  # as a driver killed with SIGKILL closes it
        assert reaper.wait(timeout=10) == 0
        raylet.wait(timeout=5)  # the SIGTERM it sent the "raylet" ended it
        time.sleep(0.3)
        assert all(gone(pid) for pid in kids)
    finally:
        for pid in [*kids, raylet.pid, reaper.pid]:
            local_ray._signal(pid, signal.SIGKILL)
