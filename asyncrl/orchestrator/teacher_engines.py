"""TeacherEngines: the real `Teacher` (teacher.py) of on-policy distillation, `algo.distill.num_engines`
Ray actors each owning a vLLM engine on the teacher model (rollout/teacher.py).

The driver submits a turn's arrivals as one call to the engine with the fewest samples
outstanding, and each poll collects the calls that finished, without waiting. The engines start
in the background while the run starts its other parts; the first call waits for its engine.
A teacher that dies or fails a call ends the run with one line saying so: its samples cannot be
trained without their teacher logprobs, and a run that went on without them would train another
objective.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from asyncrl.config import Config
from asyncrl.observe.metrics import Say
from asyncrl.orchestrator import components
from asyncrl.orchestrator.teacher import TeacherTally, attach
from asyncrl.rollout.teacher import TeacherActor
from asyncrl.types import RunFailed, Sample, as_list


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
                             num_gpus=d.num_gpus_per_engine if d.num_gpus_per_engine else None)


class TeacherEngines:
    def __init__(self, cfg: Config, say: Say = print):
        d = cfg.algo.distill
        say(f"starting {d.num_engines} teacher engine(s) on {d.teacher}")
        self.actors: list[Any] = []
        self._starts: list[Any] = []
        for i in range(d.num_engines):
            env = {"VLLM_CPU_KVCACHE_SPACE": str(d.kv_cache_gib), "VLLM_LOGGING_LEVEL": cfg.observe.engine_log_level.upper(),
                   **components.process_env(cfg, f"teacher-{i}")}
            actor = ray.remote(TeacherActor).options(
                num_cpus=d.num_cpus_per_engine, num_gpus=d.num_gpus_per_engine,
                runtime_env={"env_vars": env}).remote(teacher_engine_factory(cfg, i))
            self.actors.append(actor)
            self._starts.append(actor.start.remote())
        self._calls: dict[Any, tuple[int, list[Sample], float]] = {}  # ref -> (engine, samples, sent at)
        self._load = [0] * len(self.actors)  # samples outstanding per engine
        self.tally = TeacherTally()

    def submit(self, samples: list[Sample]) -> None:
        if not samples:
            return
        i = min(range(len(self.actors)), key=self._load.__getitem__)
        ref = self.actors[i].score.remote([(as_list(s.prompt_ids), as_list(s.response_ids)) for s in samples])
        self._calls[ref] = (i, samples, time.monotonic())
        self._load[i] += len(samples)

    def poll(self) -> list[Sample]:
        if not self._calls:
            return []
        ready, _ = ray.wait(list(self._calls), num_returns=len(self._calls), timeout=0)
        done = []
        for ref in ready:
            i, samples, sent = self._calls.pop(ref)
            self._load[i] -= len(samples)
            try:
                logprobs = ray.get(ref)
            except ray.exceptions.RayError as e:
                raise RunFailed(f"teacher engine {i} ({components.start_failure(e)}): the run cannot go on without "
                                "its samples' teacher logprobs (algo.distill)") from None
            latency = time.monotonic() - sent
            for s, lp in zip(samples, logprobs):
                done.append(attach(s, lp))
                self.tally.add(s, latency)
        return done

    @property
    def num_pending(self) -> int:
        return sum(self._load)

    def take_metrics(self) -> dict[str, float]:
        return self.tally.take(self.num_pending)

    def close(self) -> None:
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        except ray.exceptions.RayError:
            pass  # a dead or hung engine: killed below either way
        for a in self.actors:
            ray.kill(a)
