"""TeacherEngines: the real `Teacher` (teacher.py) of on-policy distillation, `algo.distill.num_engines`
Ray actors each owning a vLLM engine on the teacher model (rollout/teacher.py).

The driver submits a turn's arrivals as one call to the engine with the fewest samples
outstanding, and each poll collects the calls that finished, without waiting. The engines start
in the background while the run starts its other parts; the first call waits for its engine.
An engine whose process dies is replaced, and the samples it held go to the engines again
(`distill/teacher_restarts_total`); one that cannot start, refuses a call, or dies again and again
(MAX_LOST_IN_A_ROW without a call answered in between) ends the run with one line saying so: its
samples cannot be trained without their teacher logprobs, and a run that went on without them
would train another objective.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from asyncrl.config import Config
from asyncrl.observe.metrics import Say
from asyncrl.orchestrator import components
from asyncrl.orchestrator.placement import check_placeable
from asyncrl.orchestrator.teacher import TeacherTally, attach
from asyncrl.rollout.teacher import TeacherActor
from asyncrl.types import RunFailed, Sample, as_list


MAX_LOST_IN_A_ROW = 3


def teacher_engine_factory(cfg: Config, engine_id: int) -> Any:
    """What builds a teacher engine in its actor: vLLM on algo.distill.teacher (the fake engine,
    uniform logprobs, when the run's rollout.engine is fake)."""
    if cfg.rollout.engine == "fake":
        from asyncrl.rollout.fake_engine import FakeEngine

        return FakeEngine
    import functools

    from asyncrl.rollout.vllm_engine import VLLMEngine

    d = cfg.algo.distill
    # the built-in model as its own teacher (the student's warm start: tests, a zero-KL baseline),
    # built on the engine's node like the student's
    own = d.teacher == cfg.model.path
    teacher = components.resolve_model_path(cfg) if own else d.teacher
    return functools.partial(VLLMEngine, model_path=teacher, dtype=cfg.engine_dtype,
                             max_model_len=cfg.model.max_model_len, max_num_seqs=cfg.rollout.max_num_seqs,
                             kv_cache_gib=d.kv_cache_gib, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                             sync_type=cfg.sync.type, seed=cfg.sampling_seed + engine_id,
                             enforce_eager=cfg.rollout.enforce_eager, locate=components.locator(cfg) if own else None,
                             tensor_parallel_size=d.tensor_parallel_size,
                             num_gpus=d.num_gpus_per_engine if d.num_gpus_per_engine else None)


class TeacherEngines:
    def __init__(self, cfg: Config, say: Say = print):
        d = cfg.algo.distill
        check_placeable({"CPU": d.num_cpus_per_engine, "GPU": d.num_gpus_per_engine}, "a teacher engine",
                        "algo.distill.num_cpus_per_engine or num_gpus_per_engine")
        say(f"starting {d.num_engines} teacher engine(s) on {d.teacher}")
        self.cfg, self.say = cfg, say
        self.actors: list[Any] = [None] * d.num_engines
        self._starts: list[Any] = [None] * d.num_engines  # each engine's start call, None once it succeeded
        for i in range(d.num_engines):
            self._spawn(i)
        self._calls: dict[Any, tuple[int, Any, list[Sample], float]] = {}  # ref -> (engine, actor, samples, sent)
        self.tally = TeacherTally()
        self.restarts = 0
        self._lost_in_a_row = 0  # engines lost since a call last succeeded

    def _spawn(self, i: int) -> None:
        d = self.cfg.algo.distill
        env = {"VLLM_CPU_KVCACHE_SPACE": str(d.kv_cache_gib),
               "VLLM_LOGGING_LEVEL": self.cfg.observe.engine_log_level.upper(),
               **components.process_env(self.cfg, f"teacher-{i}")}
        self.actors[i] = ray.remote(TeacherActor).options(
            num_cpus=d.num_cpus_per_engine, num_gpus=d.num_gpus_per_engine,
            runtime_env={"env_vars": env}).remote(teacher_engine_factory(self.cfg, i))
        self._starts[i] = self.actors[i].start.remote()

    def submit(self, samples: list[Sample]) -> None:
        if not samples:
            return
        i = min(range(len(self.actors)), key=self._load)
        ref = self.actors[i].score.remote([(as_list(s.prompt_ids), as_list(s.response_ids)) for s in samples])
        self._calls[ref] = (i, self.actors[i], samples, time.monotonic())

    def _load(self, engine: int) -> int:
        """Samples outstanding at one engine."""
        return sum(len(samples) for i, _, samples, _ in self._calls.values() if i == engine)

    def poll(self) -> list[Sample]:
        self._check_started()
        if not self._calls:
            return []
        ready, _ = ray.wait(list(self._calls), num_returns=len(self._calls), timeout=0)
        done = []
        for ref in ready:
            i, actor, samples, sent = self._calls.pop(ref)
            try:
                logprobs = ray.get(ref)
            except RayActorError as e:  # its process died: a new engine, and the samples sent again
                self._replace(i, actor, e)
                self.submit(samples)
                continue
            except ray.exceptions.RayError as e:  # the engine refused them: it would again
                raise self._failed(i, e) from None
            self._lost_in_a_row = 0
            latency = time.monotonic() - sent
            for s, lp in zip(samples, logprobs):
                done.append(attach(s, lp))
                self.tally.add(s, latency)
        return done

    def _replace(self, i: int, actor: Any, error: BaseException) -> None:
        """Engine i's process died (its other calls fail too: it is replaced once)."""
        if actor is not self.actors[i]:
            return
        self._lost_in_a_row += 1
        if self._lost_in_a_row > MAX_LOST_IN_A_ROW:
            raise self._failed(i, error)
        self.restarts += 1
        self.say(f"teacher engine {i} died ({components.start_failure(error)}); starting a new one, and the "
                 "samples it held go to the engines again")
        ray.kill(actor)
        self._spawn(i)

    def _check_started(self) -> None:
        """A start that failed ends the run now, not at the first sample's call (an engine that
        cannot load the teacher), and a started engine is not looked at again."""
        waiting = [r for r in self._starts if r is not None]
        if waiting:
            for ref in ray.wait(waiting, num_returns=len(waiting), timeout=0)[0]:
                i = self._starts.index(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise self._failed(i, e) from None
                self._starts[i] = None

    @staticmethod
    def _failed(engine: int, error: BaseException) -> RunFailed:
        return RunFailed(f"teacher engine {engine} ({components.start_failure(error)}): the run cannot go on "
                         "without its samples' teacher logprobs (algo.distill)")

    @property
    def num_pending(self) -> int:
        return sum(len(samples) for _, _, samples, _ in self._calls.values())

    def take_metrics(self) -> dict[str, float]:
        return {**self.tally.take(self.num_pending), "distill/teacher_restarts_total": float(self.restarts)}

    def close(self) -> None:
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        except ray.exceptions.RayError:
            pass  # a dead or hung engine: killed below either way
        for a in self.actors:
            ray.kill(a)
