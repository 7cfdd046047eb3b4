"""Running a study's plan: each run writes an ordinary run directory, one after another in this
process on shared processes (warm_runs.py, the default), or each as an `asyncrl run` process of its
own (`cold`), one after another or N at a time on one shared Ray cluster.

Resuming: before anything starts, every run directory is read. A run whose events.jsonl ends with
a finished `end` is skipped. A run that was interrupted, failed or killed is resumed from its
newest complete checkpoint (`resume=auto`) when it has one, else restarted: its directory is moved
to <study dir>/_restarted/ and the run starts fresh. A run skipped or resumed must have in its
config.yaml every field the plan sets for it; a mismatch stops the study before anything runs (the
directory belongs to another setting). A run's console output goes to <study dir>/logs/<run>.log.
Each run is `python -m asyncrl run` under this interpreter, with the directory holding the asyncrl
the study imported (a source checkout) first on its PYTHONPATH, so the runs use that asyncrl.

Evaluating (`asyncrl study --evaluate`): after the runs, every finished run's final/ is evaluated
on the held-out data by `asyncrl evaluate` (asyncrl/lab/offline/evaluate.py) into its eval.json,
which the report reads.

Stopping: the runs start in their own sessions, so a Ctrl-C reaches only this process, which
sends each running run one SIGTERM (it stops after its step and writes a checkpoint, so the next
invocation resumes it) and starts nothing new; a second Ctrl-C sends a second SIGTERM (exit now).
"""

from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import asyncrl
from asyncrl.config.load import ConfigError, load_config
from asyncrl.lab.analysis.runs import RunStatus, config_value, read_run
from asyncrl.lab.study.plan import Action, ArmRun, Outcome, StopSignals, StudyPlan, move_aside
from asyncrl.launch import state_own_cluster_auth



def decide(status: RunStatus, has_checkpoint: bool) -> Action:
    if status == "finished":
        return "skip"
    if status == "new":
        return "start"
    return "resume" if has_checkpoint else "restart"


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) or (
        isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b))


def mismatches(run_config: dict, fields: dict[str, Any]) -> list[str]:
    """Fields the plan sets that a run's config.yaml holds differently."""
    out = []
    for key, want in fields.items():
        have = config_value(run_config, key)
        if not _same(have, list(want) if isinstance(want, tuple) else want):
            out.append(f"{key}: the run has {have!r}, the study sets {want!r}")
    return out


class StudyRunner:
    def __init__(self, plan: StudyPlan, parallel: int = 1, log: Callable[[str], None] = print, cold: bool = False):
        """`cold`: every run in a process of its own (always so with parallel > 1); by default the
        runs are made one after another in this process, on shared processes (warm_runs.py)."""
        self.plan, self.parallel, self.log, self.cold = plan, parallel, log, cold
        self.logs_dir = plan.study_dir / "logs"
        self.signals = StopSignals()
        self._running: dict[str, subprocess.Popen] = {}

    def actions(self) -> list[tuple[ArmRun, Action]]:
        """What each run needs; raises ConfigError when a finished run was made with other fields."""
        out, wrong = [], []
        for run in self.plan.runs:
            rec = read_run(run.run_dir)
            action = decide(rec.status, rec.has_checkpoint())
            if action in ("skip", "resume"):
                bad = mismatches(rec.config, run.fields)
                if bad:
                    wrong.append(f"{run.run_dir}: " + "; ".join(bad))
            out.append((run, action))
        if wrong:
            raise ConfigError("runs in the study directory were made with other settings (remove them, or give "
                              "another observe.output_dir):\n  " + "\n  ".join(wrong))
        return out

    def run(self) -> list[Outcome]:
        todo = self.actions()
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        if self.parallel == 1 and not self.cold:
            from asyncrl.lab.study.warm_runs import run_warm

            return run_warm(self.plan, todo, self.logs_dir, self.signals, self.log)
        address = self._start_cluster() if self.parallel > 1 else None
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        outcomes: list[Outcome] = []
        try:
            pending = list(enumerate(todo, 1))
            started: dict[str, tuple[Outcome, float]] = {}
            while pending or self._running:
                while pending and len(self._running) < self.parallel and not self.signals.count:
                    i, (run, action) = pending.pop(0)
                    outcome = Outcome(run.name, action)
                    outcomes.append(outcome)
                    if action == "skip":
                        outcome.status = "finished"
                        self.log(f"[{i}/{len(todo)}] {run.name}: finished before, skipped")
                        continue
                    self.log(f"[{i}/{len(todo)}] {run.name}: {action}")
                    self._launch(run, action, address)
                    started[run.name] = (outcome, time.monotonic())
                if self.signals.count and not self._running:
                    break
                self._reap(started)
                time.sleep(0.2)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if address is not None:
                import ray

                ray.shutdown()
        return outcomes

    def _launch(self, run: ArmRun, action: Action, address: str | None) -> None:
        extra = ["resume=auto"] if action == "resume" else []
        if action == "restart":
            move_aside(run, self.plan.study_dir)
        if address:
            extra.append(f"ray.address={address}")
        env = child_env()
        with open(self.logs_dir / f"{run.name}.log", "a") as out:
            out.write(f"\n$ {' '.join(run.argv(self.plan.base, *extra))}\n")
            out.flush()
            self._running[run.name] = subprocess.Popen(run.argv(self.plan.base, *extra), stdout=out,
                                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _reap(self, started: dict[str, tuple[Outcome, float]]) -> None:
        for name, proc in list(self._running.items()):
            code = proc.poll()
            if code is None:
                continue
            del self._running[name]
            outcome, t0 = started.pop(name)
            outcome.exit_code, outcome.seconds = code, round(time.monotonic() - t0, 1)
            outcome.status = read_run(self.plan.study_dir / name).status
            self.log(f"    {name}: {outcome.status} (exit {code}) after {outcome.seconds:.0f} s"
                     + ("" if code == 0 else f"; log: {self.logs_dir / (name + '.log')}"))

    def _on_signal(self, signum, frame) -> None:
        if self.signals.received(signum):
            self.log(f"\n{signal.Signals(signum).name}: stopping the running runs after their step "
                     "(they write a checkpoint; run the same command again to resume); again to stop at once")
        for proc in self._running.values():
            proc.send_signal(signal.SIGTERM)

    def _start_cluster(self) -> str:
        """One local Ray cluster the parallel runs join (unless RAY_ADDRESS names one)."""
        if os.environ.get("RAY_ADDRESS"):
            return os.environ["RAY_ADDRESS"]
        state_own_cluster_auth(None)
        import ray

        per_run = load_config(self.plan.base).ray.num_cpus or 4
        ray.init(address="local", num_cpus=per_run * self.parallel, include_dashboard=False, log_to_driver=False)
        return ray.get_runtime_context().gcs_address


def child_env() -> dict[str, str]:
    """The environment of a study's child processes: the directory holding this asyncrl first on
    PYTHONPATH, unless it is an installed one (site-packages, which the same interpreter finds
    anyway and which must not come before the standard library)."""
    home = str(Path(asyncrl.__file__).resolve().parents[1])
    installed = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    first = None if home in installed else home
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [first, os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1"}


def evaluate_finals(plan: StudyPlan, log: Callable[[str], None] = print) -> int:
    """`asyncrl evaluate --final-only` on every finished run of the plan, in one process (one vLLM
    engine for all, each run's policy pushed into it); output in logs/evaluate.log. Runs already
    evaluated with the same settings are not evaluated again. Returns its exit code."""
    runs = [str(r.run_dir) for r in plan.runs if read_run(r.run_dir).status == "finished"]
    if not runs:
        return 0
    logs = plan.study_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "asyncrl", "evaluate", *runs, "--final-only"]
    log(f"evaluating the final policy of {len(runs)} run(s); log: {logs / 'evaluate.log'}")
    t0 = time.monotonic()
    with open(logs / "evaluate.log", "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env()).returncode
    log(f"    evaluation: exit {code} after {time.monotonic() - t0:.0f} s")
    return code


def write_manifest(plan: StudyPlan, outcomes: list[Outcome]) -> Path:
    """<study dir>/study.json: every run's directory and command, and what the last invocation did
    (action, exit code, seconds per run)."""
    manifest = {"study": plan.study.name, "quick": plan.quick, "base": str(plan.base),
                "runs": [{"arm": r.arm, "seed": r.seed, "run_dir": str(r.run_dir),
                          "command": " ".join(r.argv(plan.base))} for r in plan.runs],
                "last_invocation": [asdict(o) for o in outcomes]}
    path = plan.study_dir / "study.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1))
    return path
