"""Benchmark the driver: how many samples a second one orchestrator's driver ingests, scores and
buffers, fed by 64 simulated rollout actors, against the raw zmq+msgpack rate of the same frames.

    python tools/bench_orchestrator.py [--actors 64] [--seconds 4] [--rounds 3]

The simulated actors (tools/simulated_actors.py) spend no CPU generating; a group is
granted again as soon as the driver is done with it, so the offered load only depends on the
driver's speed.

Stages, measured in alternating rounds:
- raw: one producer, frames of as many samples as the stages' carried; recv + msgpack.unpackb;
- ingest: 64 actors -> FrameReceiver + decode_samples;
- score: ingest + detokenize + the real reward pool (a verifier that costs ~1 us) and back;
- driver: the product's driver (orchestrator/driver.py), through the one loop turn the
  orchestrator and the twin call (`Driver.turn`): ingest and rewards every turn; every
  BOOKKEEPING_S its admission (prompts from the built-in task, up to groups_per_actor an actor)
  and a batch for a learner that trains it at once, split and encoded for a rank as the learner
  group does, with the step's row (`Driver.end_step`);
- driver_actor_rewards: the same with `reward.placement: actor` (rewards arrive in the frames).
The driver's rate counts samples of groups the buffer took or rejected; the ratio to raw and the
driver's cores say where it saturates (`py-spy record -- python tools/bench_orchestrator.py`).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path

import msgpack
import zmq

from asyncrl.config import RewardConfig
from asyncrl.reward.registry import build_reward_pool
from asyncrl.transport.codec import decode_samples, encode_batch, encode_samples
from asyncrl.transport.zmq_stream import FrameReceiver
from asyncrl.types import Sample
from simulated_actors import VERIFIER, SimulatedActors, Workload, group_samples  # beside this file


def producer(endpoint: str, frames: list[bytes]) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(endpoint)  # sends until it is killed
    while True:
        for f in frames:
            sock.send(f)


def raw_rate(args, seconds: float, per_frame: int) -> float:
    """One producer, one consumer, frames of `per_frame` samples, msgpack.unpackb and no more."""
    samples = [s for g in range(args.groups_per_actor) for s in group_samples(0, g, args, random.Random(0))]
    frames = [encode_samples(samples[i:i + per_frame]) for i in range(0, len(samples) - per_frame + 1, per_frame)]
    sock = zmq.Context.instance().socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=producer, args=(f"tcp://127.0.0.1:{port}", frames), daemon=True)
    proc.start()
    sock.poll(30_000)
    for _ in range(2000):  # warm
        sock.recv()
    count, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        msgpack.unpackb(sock.recv(), raw=False)
        count += per_frame
    rate = count / (time.monotonic() - t0)
    proc.kill()
    sock.close(linger=0)
    return rate


class Ingest:
    """Stage "ingest": Samples decoded from the stream, nothing else. Each actor is granted its
    groups_per_actor groups at the start and each again as soon as the stage is done with it."""

    def __init__(self, receiver: FrameReceiver, args):
        self.receiver, self.n, self.arrived = receiver, args.group_size, Counter()
        self.groups = [(a, g) for a in range(args.actors) for g in range(args.groups_per_actor)]
        self.key = {f"a{a}g{g}": (a, g) for a, g in self.groups}
        self.completed = self.outstanding = 0  # samples through the stage; groups granted, not through
        self.actors: SimulatedActors | None = None
        self.stopping = False

    def start(self, actors: SimulatedActors) -> None:
        self.actors, self.stopping = actors, False
        self.grant(self.groups)

    def drain(self) -> None:
        """Grant nothing more: `turn` until nothing is outstanding."""
        self.stopping = True

    def grant(self, groups: list[tuple[int, int]]) -> None:
        if groups and not self.stopping:
            self.outstanding += len(groups)
            self.actors.grant(groups)

    def arrivals(self) -> list[Sample]:
        return self.receiver.take(0.01)  # as the orchestrator waits (driver.RECV_WAIT_S)

    def count(self, group_ids) -> None:
        """Groups whose n samples have all completed the stage are granted again."""
        done = []
        for gid in group_ids:
            self.arrived[gid] += 1
            if self.arrived[gid] == self.n:
                del self.arrived[gid]
                done.append(self.key[gid])
        self.completed += len(group_ids)
        self.outstanding -= len(done)
        self.grant(done)

    def turn(self) -> None:
        self.count([s.group_id for s in self.arrivals()])


class Score(Ingest):
    """Stage "score": ingest, detokenize, a round trip through the reward pool."""

    def __init__(self, receiver, args, rewards, tokenizer):
        from asyncrl.reward.decode import batch_decoder

        super().__init__(receiver, args)
        self.rewards, self.decode = rewards, batch_decoder(tokenizer)

    def turn(self) -> None:
        got = self.arrivals()
        self.rewards.submit_many([(s, t, s.metadata) for s, t in zip(got, self.decode([s.response_ids for s in got]))])
        self.count([r.key.group_id for r in self.rewards.poll()])


class DriverStage(Ingest):
    """Stage "driver": the product's driver turned as orchestrator.py turns it (Driver.turn), its
    admission granting the simulated actors their prompts (up to groups_per_actor each, as the
    other stages grant them), and a learner that takes each batch at once."""

    def __init__(self, receiver, args, tmp: Path, run: str):
        from asyncrl.buffer.packing import rank_batches
        from asyncrl.config import load_config
        from asyncrl.observe.metrics import MetricsWriter
        from asyncrl.orchestrator.driver import StepState, build_driver

        super().__init__(receiver, args)
        cfg = load_config(None, [
            f"reward.type={VERIFIER}", f"reward.num_workers={args.reward_workers}", f"rollout.group_size={args.group_size}",
            f"rollout.max_tokens={args.response_tokens}", f"buffer.token_budget={args.token_budget}", "eval.every_steps=0",
            f"rollout.num_actors={args.actors}", f"rollout.max_in_flight_prompts={args.groups_per_actor}",
            "buffer.max_staleness=1000000",  # the per-actor bound alone limits what is offered, as in the other stages
            f"model.max_model_len={args.prompt_tokens + args.response_tokens + 64}", "observe.tensorboard=false",
            f"observe.output_dir={tmp}"])
        self.driver = build_driver(cfg, str(tmp), MetricsWriter(tmp / run, tensorboard=False))
        self.driver.wait_ready()
        self.rank_batches, self.states, self.state = rank_batches, StepState, StepState.IDLE
        self.step = self.version = 0
        self.actor_ids = list(range(args.actors))

    def step_state(self):  # the driver's LearnerView
        return self.state

    def start(self, actors: SimulatedActors) -> None:  # the driver's admission grants
        self.actors, self.stopping = actors, False

    def turn(self) -> None:
        d, arrivals = self.driver, self.arrivals()
        acts = d.turn(time.monotonic(), arrivals, self)
        by_actor: dict[int, list[str]] = {}
        for g in acts.grants:
            by_actor.setdefault(g.actor, []).extend(p.prompt_id for p in g.prompts)
        self.actors.grant([(a, gid) for a, gids in by_actor.items() for gid in gids])
        if acts.step_done:
            self.step, self.version, self.state = self.step + 1, self.version + 1, self.states.IDLE
            d.end_step(self.step, {}, self.receiver.num_dropped)
        if acts.batch is not None:  # split and encoded for a rank as the learner group does; trained at once
            b = acts.batch
            for part in self.rank_batches(self.step + 1, b.chunks, 1, b.token_budget, b.role, None):
                encode_batch(part)
            self.state = self.states.DONE
        c = d.accounting()["samples"]
        self.completed, self.outstanding = c["kept"] + c["rejected"], d.in_flight()

def measure(stage: Ingest, actors: SimulatedActors, collector, args) -> tuple[float, float]:
    """Samples/s through `stage` over `args.seconds` after a second of warm-up and the driver
    process's CPU use in cores; then lets every granted group finish."""
    import psutil

    me = psutil.Process()
    stage.start(actors)
    t_start, mark = time.monotonic(), None
    while True:
        stage.turn()
        collector.maybe_collect()  # as the orchestrator's loop does
        now = time.monotonic()
        if mark is None and now - t_start >= 1.0:
            mark = (now, stage.completed, sum(me.cpu_times()[:2]))
        if mark is not None and now - mark[0] >= args.seconds:
            break
    wall = now - mark[0]
    rate, cores = (stage.completed - mark[1]) / wall, (sum(me.cpu_times()[:2]) - mark[2]) / wall
    stage.drain()
    deadline = time.monotonic() + 60
    while stage.outstanding and time.monotonic() < deadline:
        stage.turn()
    if stage.outstanding:
        raise RuntimeError(f"{stage.outstanding} groups never completed")
    return rate, cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Workload):  # the simulated actors' workload (tools/simulated_actors.py)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--token-budget", type=int, default=8192, help="Phi: loss tokens per batch")
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured time per stage and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workload = Workload(**{f.name: getattr(args, f.name) for f in fields(Workload)})

    from asyncrl.orchestrator.collector import ScheduledCollector
    from asyncrl.tiny.tokenizer import save_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-bench-orch-"))
    tokenizer = save_tokenizer(tmp)
    receiver = FrameReceiver(decode_samples)
    actors = SimulatedActors(receiver.endpoint, workload)
    drivers = {name: DriverStage(receiver, args, tmp, name) for name in ("driver", "driver_actor_rewards")}
    score_pool = build_reward_pool(RewardConfig(type=VERIFIER, num_workers=args.reward_workers), {})
    score_pool.wait_ready()
    stages = {"ingest": Ingest(receiver, args), "score": Score(receiver, args, score_pool, tokenizer), **drivers}
    collector = ScheduledCollector()  # as the orchestrator does at the end of its start-up
    collector.start()
    print(f"{args.actors} simulated actors in {args.hosts} processes, {args.groups_per_actor} groups of {args.group_size} "
          f"each at a time, {args.prompt_tokens}+{args.response_tokens} tokens a sample, {args.gen_s * 1000:.0f} ms a "
          f"sample: up to {args.actors * args.groups_per_actor * args.group_size / args.gen_s:,.0f} samples/s offered")
    rates: dict[str, list[float]] = {name: [] for name in ["raw", *stages]}
    try:
        for r in range(args.rounds):
            line, frames_before, records_before = "", receiver.num_frames, receiver.num_received
            for name, stage in stages.items():
                actors.with_rewards = name == "driver_actor_rewards"
                rate, cores = measure(stage, actors, collector, args)
                rates[name].append(rate)
                line += f" | {name} {rate:,.0f} ({cores:.2f} cores)"
            per_frame = (receiver.num_received - records_before) / (receiver.num_frames - frames_before)
            rates["raw"].append(raw_rate(args, args.seconds, max(1, round(per_frame))))
            print(f"round {r + 1}: {per_frame:.2f} samples a frame, raw {rates['raw'][-1]:,.0f}{line} samples/s", flush=True)
    finally:
        actors.stop()
        for stage in drivers.values():
            stage.driver.close()
        score_pool.close()
        collector.release()
    raw = statistics.median(rates["raw"])
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:<20} {med:10,.0f} samples/s (median of {len(values)}), {med / raw:5.2f} of raw")
    for name, stage in drivers.items():
        print(f"{name} accounting: {stage.driver.accounting()['samples']}")
    print(f"garbage collector (scheduled): {collector.num_collections} full collections, {collector.total_s:.2f} s in all")


if __name__ == "__main__":
    main()
