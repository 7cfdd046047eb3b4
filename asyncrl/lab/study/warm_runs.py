"""A study's runs in this process, one after another, on one Ray cluster and one set of learner
ranks and rollout actors (asyncrl/orchestrator/warm.py): each run after the first skips the
start-up of Ray, the vLLM engines and the learner, which is most of a short run's cost.

Each run is what `asyncrl run` would make of the same config: the same preflight, run lock, run
directory and exit status; its console output goes to <study dir>/logs/<run>.log, and the
processes' own output to the run's logs/. A run whose process-shaping fields differ from the last
one's (a study that varies rollout.dtype, say) gets new processes, and says why in its log. A run
that fails ends its processes too, so the next one starts on fresh ones.

Stopping: the first SIGINT / SIGTERM / SIGHUP asks the running run to stop after its step (it
writes a checkpoint; the next invocation resumes it) and starts nothing new; a second exits now.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrl.config.load import ConfigError, format_override, load_config
from asyncrl.lab.analysis.runs import read_run

from asyncrl.lab.study.plan import Action, ArmRun, Outcome, StopSignals, StudyPlan, move_aside

if TYPE_CHECKING:
    from asyncrl.orchestrator.warm import Warm


def run_warm(plan: StudyPlan, todo: list[tuple[ArmRun, Action]], logs_dir: Path, signals: StopSignals,
             log: Callable[[str], None]) -> list[Outcome]:
    """Make the runs of `todo` in order in this process; their outcomes. Each run's output goes to
    `logs_dir`/<run>.log; a signal stops the running run after its step (`signals` counts them)."""
    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.launch import connect_ray, state_own_cluster_auth

    outcomes: list[Outcome] = []
    current: list[Any] = [None]  # the running Orchestrator, for the signal handler

    def on_signal(signum, frame):
        if not signals.received(signum):
            os._exit(128 + signum)
        starting = current[0] is not None and current[0].starting
        doing = ("stopping the run's start" if starting
                 else "stopping the running run after its step (it writes a checkpoint)")
        log(f"\n{signal.Signals(signum).name}: {doing}; run the same command again to resume; again to stop at once")
        if current[0] is not None:
            current[0].request_stop(signal.Signals(signum).name)

    if not any(action != "skip" for _, action in todo):
        return [_skipped(Outcome(run.name, action), i, len(todo), log) for i, (run, action) in enumerate(todo, 1)]
    sys.path.insert(1, os.getcwd())  # a user's reward module beside their data, as `asyncrl run` finds it
    hide_broken_torch_extras()  # before Ray starts: its workers inherit the environment
    base = load_config(plan.base)
    state_own_cluster_auth(base.ray.address)
    connect_ray(base.ray.address, base.ray.num_cpus, base.observe.worker_logs)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    warm: Warm | None = None
    try:
        for i, (run, action) in enumerate(todo, 1):
            outcome = Outcome(run.name, action)
            if action == "skip":
                outcomes.append(_skipped(outcome, i, len(todo), log))
                continue
            if signals.count:
                break
            outcomes.append(outcome)
            log(f"[{i}/{len(todo)}] {run.name}: {action}")
            if action == "restart":
                move_aside(run, plan.study_dir)
            overrides = [format_override(k, v) for k, v in run.fields.items()]
            overrides += ["resume=auto"] if action == "resume" else []
            t0 = time.monotonic()
            with open(logs_dir / f"{run.name}.log", "a") as out:
                out.write(f"\n$ asyncrl run --config {plan.base} {' '.join(overrides)}   (in the study's process)\n")
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    code, warm, reused = _one_run(plan.base, overrides, warm, current, out)
            outcome.exit_code, outcome.seconds = code, round(time.monotonic() - t0, 1)
            outcome.status = read_run(run.run_dir).status
            log(f"    {run.name}: {outcome.status} (exit {code}) after {outcome.seconds:.0f} s"
                + (" on the last run's processes" if reused else "")
                + ("" if code == 0 else f"; log: {logs_dir / (run.name + '.log')}"))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if warm is not None:
            warm.shutdown(say=log)
        import ray

        ray.shutdown()
    return outcomes


def _skipped(outcome: Outcome, i: int, n: int, log) -> Outcome:
    outcome.status = "finished"
    log(f"[{i}/{n}] {outcome.run}: finished before, skipped")
    return outcome


def _one_run(base: Path, overrides: list[str], warm: Warm | None, current: list[Any],
             out) -> tuple[int, Warm | None, bool]:
    """One run as `asyncrl run` would make it (launch.py's exit codes), on `warm`'s processes when
    they fit; returns its exit code, the processes it leaves for the next run and whether it ran
    on `warm`'s."""
    from asyncrl.orchestrator.orchestrator import Orchestrator
    from asyncrl.orchestrator.run_lock import claim_run_dir
    from asyncrl.preflight import preflight
    from asyncrl.types import RunFailed, StartInterrupted

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    try:
        cfg = preflight(load_config(base, overrides))
        orch = Orchestrator(cfg, log_fn=say, run_lock=claim_run_dir(cfg.run_dir.resolve(), cfg.resume))
    except ConfigError as e:
        say(f"error: {e}")
        return 2, warm, False
    if warm is not None and (differ := warm.fits(cfg)):
        say(f"starting new processes: {', '.join(differ)} differ from the last run's")
        warm.shutdown(say=say)
        warm = None
    current[0], code, reused = orch, 0, warm is not None
    try:
        orch.run(warm)
    except ConfigError as e:
        say(f"error: {e}")
        code = 2
    except RunFailed as e:
        say(f"error: {e}")
        code = 1
    except StartInterrupted as e:  # a signal while it started: no step to save
        say(e.line())
        code = 128 + signal.Signals[e.reason]
    except Exception:  # a bug or a lost process: its traceback in the run's log, the study goes on
        say(traceback.format_exc())
        code = 1
    finally:
        current[0] = None
    if code == 0:
        return (128 + signal.Signals[orch.stop_reason] if orch.stop_reason in signal.Signals.__members__ else 0,
                orch.release(), reused)
    if warm is not None and orch.learner is not warm.learner:  # it failed before taking them over
        warm.shutdown(say=say)
    orch.shutdown()
    return code, None, reused
