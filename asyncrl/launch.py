"""One run, start to finish: `asyncrl run [--config <recipe>] [--print-config] [section.field=value ...]`
(`python launch/run.py ...` and `python -m asyncrl run ...` are the same; asyncrl/cli/run.py parses).

Starts a local Ray cluster, or joins the one `ray job submit` (or RAY_ADDRESS / ray.address)
points at, then hands the config to the orchestrator. With no --config it runs the tiny CPU
default, which trains the locally built tiny model on the built-in arithmetic task. Before Ray
starts, the config, the model path, the lengths, the packages it needs and every data record are
checked (asyncrl/preflight.py); `--print-config` prints the resolved config and exits.

SIGTERM or SIGINT (Ctrl-C, `ray job stop`) stops the run cleanly: no new prompts, the running step
finishes, a checkpoint is written, everything shuts down; `resume=auto` continues it. While the run
is still starting (engines loading) it stops the start instead, with nothing to save. A second
signal exits at once. Exit codes: 0 finished, 1 failed (a learner lost once more than
fault.max_restarts allows: resume from the newest checkpoint; no optimizer step for
observe.stall_timeout_s; a reward function failing on more than reward.max_error_frac of the
samples; a weight push that failed twice), 2 bad config or data, 128 + signal number after a
clean stop, start-up included (130 for a Ctrl-C while the config and data are checked).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from asyncrl.local_ray import end_local_ray, local_ray_exited, start_reaper


def state_own_cluster_auth(address: str | None) -> None:
    """Before a local Ray cluster of our own starts (no `address`, no RAY_ADDRESS): Ray gives a
    cluster it starts token authentication when RAY_AUTH_MODE is unset, and warns at every start
    that it did; stating the same mode silences that. Ray reads the mode once, when it is
    imported, so it is stated only if Ray is not imported yet (set later, the driver would keep
    "disabled" while the cluster it starts takes "token", and fail to authenticate). A mode the
    user set, and a cluster of the user's, are left as they are."""
    own = not (address or os.environ.get("RAY_ADDRESS"))
    if own and "RAY_AUTH_MODE" not in os.environ and "ray" not in sys.modules:
        os.environ["RAY_AUTH_MODE"] = "token"


def connect_ray(address: str | None, num_cpus: int | None, worker_logs: str) -> None:
    """Workers' output goes to the driver's console only with observe.worker_logs=console; else
    the learner and actors write it to the run's logs/ (components.py) and Ray keeps its own."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    common = {"log_to_driver": worker_logs == "console", "logging_level": logging.WARNING}
    if address:
        ray.init(address=address, **common)
    else:  # "local": a cluster of our own even if `ray start` left one running on this machine
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **common)


def launch(config: str | None, overrides: list[str], print_config: bool = False) -> int:
    """Run `config` (a recipe path or a shipped recipe's name; None: the tiny CPU default) with the
    dotted `overrides`; the exit code (see the module docstring)."""
    try:
        return _launch(config, overrides, print_config)
    except KeyboardInterrupt:  # before the stop handlers are in place: nothing to save yet
        print("\ninterrupted during start-up; nothing was trained", file=sys.stderr)
        return 130


def _launch(config: str | None, overrides: list[str], print_config: bool) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # A script's sys.path starts with its own directory (launch/, or bin/ for `asyncrl`), not the
    # one it is run from; a user's reward module beside their data (or in a `ray job submit
    # --working-dir`) is found there, and the reward workers inherit this path
    sys.path.insert(1, os.getcwd())
    from asyncrl.config import ConfigError, dump_config, load_config
    from asyncrl.preflight import preflight, resolve

    try:
        cfg = load_config(config, overrides)
        if print_config:
            print(dump_config(resolve(cfg)), end="")
            return 0
        cfg = preflight(cfg)  # model, lengths, packages, data, reward functions: a second, not a traceback later
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    state_own_cluster_auth(cfg.ray.address)  # before the imports below bring Ray in
    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.orchestrator.orchestrator import Orchestrator
    from asyncrl.orchestrator.run_lock import claim_run_dir
    from asyncrl.types import RunFailed, StartInterrupted

    try:  # one live run per directory, and none started over a finished one without resume=
        lock = claim_run_dir(cfg.run_dir.resolve(), cfg.resume)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hide_broken_torch_extras()  # before Ray starts: its workers inherit the environment
    # A Ctrl-C while Ray starts its daemons can land in code of Ray's that swallows the
    # KeyboardInterrupt (seen: a run that then trained all its steps), so from here until the
    # stop handlers are in place a signal is only noted, and acted on once Ray is up.
    early: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: early.append(signum))
    connect_ray(cfg.ray.address, cfg.ray.num_cpus, cfg.observe.worker_logs)
    start_reaper()  # a cluster of our own ends with this driver, even one killed with SIGKILL
    try:
        orch = Orchestrator(cfg, run_lock=lock)
    except ConfigError as e:  # checks that need the data or imports: sources, reward functions
        print(f"error: {e}", file=sys.stderr)
        return 2
    if early:
        lock.release()
        print("\ninterrupted during start-up; nothing was trained", file=sys.stderr)
        return 128 + early[0]
    finished = threading.Event()  # the run has shut down: Ray's daemons exiting now is no news
    stopped = install_stop_handlers(orch, finished)
    try:
        orch.run()
    except ConfigError as e:  # found at start: a checkpoint that does not fit this config, data sources
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:  # a lost learner, a stall, a reward function that keeps failing
        print(f"error: {e}", file=sys.stderr)
        return 1
    except StartInterrupted as e:  # the exit code below says which signal
        print(e.line(), file=sys.stderr, flush=True)
    finally:
        orch.shutdown()
        finished.set()
    return 128 + stopped[0] if stopped else 0


def install_stop_handlers(orch, finished: threading.Event) -> list[int]:
    """First SIGTERM/SIGINT: a clean stop with a checkpoint; a second: exit now. Installed after
    Ray starts, which sets its own SIGTERM handler in the driver."""
    got: list[int] = []

    def handler(signum, frame):
        if got:
            end_local_ray()
            os._exit(128 + signum)
        got.append(signum)
        name = signal.Signals(signum).name
        doing = "stopping the start" if orch.starting else "stopping after the running step and writing a checkpoint"
        print(f"\n{name}: {doing} (send it again to exit at once)", file=sys.stderr, flush=True)
        orch.request_stop(name, drain_s=0.0 if under_ray_job() else 20.0)
        threading.Thread(target=_exit_if_ray_is_gone, args=(orch, signum, finished), daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return got


def _exit_if_ray_is_gone(orch, signum: int, finished: threading.Event) -> None:
    """A signal sent to the whole process group (`kill -- -<pgid>`, `timeout`, a batch scheduler)
    reaches the local Ray cluster this driver started too: Ray puts its daemons in the driver's
    process group and blocks only SIGINT in them. With the GCS gone nothing can be saved, and the
    driver's Ray client would wait 60 s for it and print its own errors; say so in one line instead."""
    while not finished.wait(0.25):  # until the clean stop is done, or this ends the process
        gone = local_ray_exited()
        if gone and not finished.is_set():
            newest = orch.checkpoints.newest()
            where = f"the newest checkpoint is {newest}" if newest else "no checkpoint was written"
            print(f"{signal.Signals(signum).name} reached this run's Ray processes too ({', '.join(gone)} exited: the "
                  f"whole process group was signalled), so no checkpoint can be written; {where}; continue with "
                  "resume=auto (signal the driver's pid alone for a clean stop)", file=sys.stderr, flush=True)
            os._exit(128 + signum)


def under_ray_job() -> bool:
    """Whether this driver is a `ray job submit` entrypoint. `ray job stop` sends SIGTERM, then
    SIGKILL RAY_JOB_STOP_WAIT_TIME_S later (3 s by default): there is no time to let the groups
    in flight finish (a resume regenerates them), only the running step and the checkpoint."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ  # set by Ray's job supervisor
