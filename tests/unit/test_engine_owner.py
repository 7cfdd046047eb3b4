"""asyncrl/rollout/owner.py: a process started under a rollout actor ends within a second or two of
the actor's end, whichever way the actor ended; other processes are left alone."""

import os
import signal
import subprocess
import sys
import time

from asyncrl.rollout import owner

WATCHED = "from asyncrl.rollout import owner; owner.watch(); import time; time.sleep(60)"


def start_watched(token=None):
    env = {k: v for k, v in os.environ.items() if k != owner.ENV}
    if token is not None:
        env[owner.ENV] = token
    return subprocess.Popen([sys.executable, "-c", WATCHED], env=env)


def ended_within(proc, seconds):
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_a_token_tells_a_live_process_from_an_ended_one_and_a_zombie():
    me = owner.owner_token()
    assert me.startswith(f"{os.getpid()}:") and owner.alive(me)
    child = subprocess.Popen(["sleep", "30"])
    token = owner.owner_token(child.pid)
    assert owner.alive(token)
    child.kill()
    time.sleep(0.2)  # not reaped yet: a zombie is gone too
    assert not owner.alive(token)
    child.wait()
    assert not owner.alive(token)
    # the same pid with another start time is another process
    assert not owner.alive(f"{os.getpid()}:1")


def test_the_watched_process_is_killed_when_its_owner_ends():
    actor = subprocess.Popen(["sleep", "60"])  # stands in for the rollout actor
    engine = start_watched(owner.owner_token(actor.pid))
    time.sleep(1.5)  # the child has imported and started watching
    assert engine.poll() is None
    actor.send_signal(signal.SIGKILL)
    actor.wait()
    assert ended_within(engine, 2 * owner.POLL_S + 3), "the engine process outlived its actor"
    assert engine.returncode == -signal.SIGKILL


def test_processes_without_the_variable_or_that_are_the_owner_are_left_alone():
    plain = start_watched()  # any other use of vLLM: the plugin loads, and watches nothing
    try:
        time.sleep(1.5 + owner.POLL_S)
        assert plain.poll() is None
    finally:
        plain.kill()
        plain.wait()
    # a process naming itself (the actor, which also loads vLLM's plugins) does not watch itself
    me = owner.owner_token()
    os.environ[owner.ENV] = me
    try:
        owner.watch()
        assert not owner._watching
    finally:
        del os.environ[owner.ENV]


BARS = ("import threading\nfrom asyncrl.rollout import owner\nowner.watch()\nfrom tqdm import tqdm\n"
        "list(tqdm(range(3), disable=False))\nprint(type(tqdm.get_lock()) is type(threading.RLock()))")


def test_a_watched_process_draws_progress_bars_without_a_semaphore_a_kill_would_leak():
    """It is killed at shutdown: a multiprocessing lock of tqdm's would be left to the resource
    tracker, which warns of a leaked semaphore (it ended `asyncrl evaluate`)."""
    outs = []
    for token in (owner.owner_token(), None):  # under an engine's owner; any other process
        env = {k: v for k, v in os.environ.items() if k != owner.ENV}
        if token is not None:
            env[owner.ENV] = token
        outs.append(subprocess.run([sys.executable, "-c", BARS], env=env, capture_output=True, text=True,
                                   timeout=60, check=True).stdout.strip())
    assert outs == ["True", "False"]
