"""Benchmark the driver: how many samples a second one orchestrator ingests, scores and buffers,
fed by 64 simulated rollout actors, against the raw zmq+msgpack rate of the same frames.

    python tools/bench_orchestrator.py [--actors 64] [--seconds 4] [--rounds 3] [--profile out.txt]

The simulated actors are fake engines that wait as a GPU would and use no CPU: a process hosts
many of them (`--hosts`, 4 by default), each with a zmq PUSH socket of its own, as every
RolloutActor has; 64 Ray actor processes would not fit beside the driver on 2 cores. A sample of
a granted group finishes `--gen-s` (x 0.5-1.5) later, at the end of its actor's engine step
(`--step-s`, by default one decode step per response token: an engine hands out together the
requests that finished in one step), and the actor sends the samples that finished together in
one frame with the real codec (`encode_samples`), as RolloutActor's RecordBatcher does. Samples
(and, for actor-scored runs, their rewards) are built beforehand: on a cluster that is the actor
node's work, here it would take the driver's cores. The driver grants a group again as soon as
it is done with it (the stand-in for admission and `RolloutActor.submit`: a zmq message, not a
Ray call), so the actors never run ahead of it and the offered load only depends on its speed.

Stages, each a whole pipeline measured on its own, in alternating rounds:
- raw (after the others, each round): one producer process sends frames of as many samples as
  the stages' frames carried on average to one PULL socket; recv + msgpack.unpackb;
- ingest: 64 actors -> FrameReceiver + decode_samples (Samples, nothing else);
- score: ingest + detokenize + the real reward pool (2 workers, a verifier that costs ~1 us) and
  back: what scoring itself costs the driver;
- driver: the orchestrator's loop (orchestrator.py, `_run`): `SampleIntake` (ledger, reward pool,
  result router: shaping, groups, advantages, the token buffer) every turn, and every
  BOOKKEEPING_S the admission bookkeeping (`ledger.capacity`, `generating_by_actor`) and every full
  Phi batch cut from the buffer, counted in the step statistics and encoded for a learner rank
  (`encode_batch`). The driver imports the orchestrator's module, so its heap is a run's, and its
  garbage collector runs as the orchestrator's does (orchestrator/collector.py: every stage here).
- driver_actor_rewards: the same loop with `reward.placement: actor`: each actor scored its
  samples beside its engine (same verifier, its reward in the frame, computed beforehand like the
  encoding: on a cluster that is the actor node's work), and the driver's pool is idle.
A stage's rate counts samples that completed it; for the driver, samples of groups the buffer
took or rejected. The ratio to raw and the driver process's CPU use say where it saturates;
`--profile FILE` records the driver with py-spy during the first round of both driver stages
(FILE.driver, FILE.driver_actor_rewards) and prints the functions that took its time.
"""

from __future__ import annotations

import argparse
import heapq
import math
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import msgpack
import zmq

from asyncrl.transport.codec import decode_samples, encode_samples
from asyncrl.transport.zmq_stream import FrameReceiver, FrameSender
from asyncrl.types import PromptItem, Sample

VERIFIER = "import:asyncrl.reward.fault_injection:by_response_hash"  # a crc32: rewards mixed in a group


def metadata(group: int) -> dict:
    return {"answer": "12", "data_source": "tiny_arith", "record_key": f"tiny_arith/{group}"}


def group_samples(actor: int, group: int, args, rng: random.Random) -> list[Sample]:
    """The n samples of one group, as a RolloutActor sends them (token ids of the tiny model)."""
    gid, prompt, r = f"a{actor}g{group}", [rng.randrange(3, 98) for _ in range(args.prompt_tokens)], args.response_tokens
    return [Sample(gid, gid, i, prompt, [rng.randrange(3, 98) for _ in range(r)], [-1.0] * r, [0] * r,
                   "stop" if i % 2 else "length", actor, metadata(group)) for i in range(args.group_size)]


def scored(s: Sample, tokenizer) -> Sample:
    """The sample as an actor that scored it itself sends it (reward.placement: actor)."""
    from asyncrl.reward.fault_injection import by_response_hash

    s = replace(s)
    s.reward, s.reward_info = by_response_hash(tokenizer.decode(s.response_ids, skip_special_tokens=True), s.metadata)
    s.reward_info.update(verifier=VERIFIER, data_source=s.metadata["data_source"])  # as RewardRouter adds them
    s.reward_latency_s = 1e-5
    return s


def actor_host(endpoint: str, grants_endpoint: str, actors: list[int], args) -> None:
    """Many simulated actors in one process. A sample finishes `--gen-s` (x 0.5-1.5) after its
    group is granted, at the end of its actor's engine step (every `--step-s`: an engine hands out
    the requests that finished in a step together, and the actor's RecordBatcher sends those in
    one frame, as RolloutActor does)."""
    from asyncrl.tiny.tokenizer import build_tokenizer

    rng, tokenizer = random.Random(actors[0]), build_tokenizer()
    plain = {(a, g): group_samples(a, g, args, rng) for a in actors for g in range(args.groups_per_actor)}
    with_rewards = {key: [scored(s, tokenizer) for s in group] for key, group in plain.items()}
    phase = {a: rng.random() * args.step_s for a in actors}  # the actors' steps are not in lockstep
    sockets = {a: FrameSender(endpoint) for a in actors}
    grants = zmq.Context.instance().socket(zmq.PULL)
    grants.connect(grants_endpoint)
    due: list[tuple[float, int, int, int, bool]] = []  # (when, actor, group, sample index, scored)

    def step_end(a: int, t: float) -> float:
        return t if not args.step_s else phase[a] + math.ceil((t - phase[a]) / args.step_s) * args.step_s

    while True:
        wait_ms = max(0.0, due[0][0] - time.monotonic()) * 1000 if due else 100
        while grants.poll(wait_ms):
            wait_ms = 0
            msg = msgpack.unpackb(grants.recv())
            if msg is None:
                return
            now, (scored_by_actor, pairs) = time.monotonic(), msg
            for a, g in pairs:
                for i in range(args.group_size):
                    heapq.heappush(due, (step_end(a, now + args.gen_s * (0.5 + rng.random())), a, g, i, scored_by_actor))
        now, finished = time.monotonic(), {}
        while due and due[0][0] <= now:
            _, a, g, i, scored_by_actor = heapq.heappop(due)
            finished.setdefault(a, []).append((with_rewards if scored_by_actor else plain)[a, g][i])
        for a, samples in finished.items():
            sockets[a].send(encode_samples(samples))


class Actors:
    """The simulated actors' processes and the driver's grant sockets to them."""

    def __init__(self, endpoint: str, args):
        ctx, per = zmq.Context.instance(), -(-args.actors // args.hosts)
        self.host_of, self.sockets, self.procs = {}, [], []
        self.with_rewards = False  # whether the actors send their samples scored
        for h in range(args.hosts):
            actors = list(range(h * per, min((h + 1) * per, args.actors)))
            sock = ctx.socket(zmq.PUSH)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            self.sockets.append(sock)
            self.host_of.update(dict.fromkeys(actors, h))
            proc = mp.get_context("spawn").Process(target=actor_host, daemon=True,
                                                   args=(endpoint, f"tcp://127.0.0.1:{port}", actors, args))
            proc.start()
            self.procs.append(proc)

    def grant(self, groups: list[tuple[int, int]]) -> None:
        by_host: dict[int, list] = {}
        for a, g in groups:
            by_host.setdefault(self.host_of[a], []).append((a, g))
        for h, pairs in by_host.items():
            self.sockets[h].send(msgpack.packb([self.with_rewards, pairs]))

    def stop(self) -> None:
        for sock in self.sockets:
            sock.send(msgpack.packb(None))
        for proc in self.procs:
            proc.join(10)


def producer(endpoint: str, frames: list[bytes]) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(endpoint)
    while True:
        for f in frames:
            sock.send(f)


def raw_rate(args, seconds: float, per_frame: int) -> float:
    """One producer, one consumer, frames of `per_frame` samples (as many as the stages' frames
    carried), msgpack.unpackb and no more: the ceiling of the transport, in samples/s."""
    rng = random.Random(0)
    samples = [s for g in range(args.groups_per_actor) for s in group_samples(0, g, args, rng)]
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
    """Stage "ingest": Samples decoded from the stream, nothing else."""

    def __init__(self, receiver: FrameReceiver, args):
        self.receiver, self.n = receiver, args.group_size
        self.key = {f"a{a}g{g}": (a, g) for a in range(args.actors) for g in range(args.groups_per_actor)}
        self.arrived: Counter = Counter()
        self.completed = self.outstanding = 0  # samples through the stage; groups granted, not through

    def grant(self, groups: list[tuple[int, int]]) -> None:
        """Groups the actors are told to generate (again)."""
        self.outstanding += len(groups)

    def arrivals(self) -> list[Sample]:
        got = self.receiver.drain()
        sample = self.receiver.recv(timeout_s=0.01)
        return got + [sample] if sample is not None else got

    def count(self, group_ids) -> list[tuple[int, int]]:
        """Groups whose n samples have all completed the stage: to be granted again."""
        done = []
        for gid in group_ids:
            self.arrived[gid] += 1
            if self.arrived[gid] == self.n:
                del self.arrived[gid]
                done.append(self.key[gid])
        self.completed += len(group_ids)
        self.outstanding -= len(done)
        return done

    def turn(self) -> list[tuple[int, int]]:
        return self.count([s.group_id for s in self.arrivals()])


class Score(Ingest):
    """Stage "score": ingest, detokenize, a round trip through the reward pool."""

    def __init__(self, receiver, args, rewards, tokenizer):
        from asyncrl.reward.decode import batch_decoder

        super().__init__(receiver, args)
        self.rewards, self.decode = rewards, batch_decoder(tokenizer)

    def turn(self) -> list[tuple[int, int]]:
        got = self.arrivals()
        texts = self.decode([s.response_ids for s in got])
        self.rewards.submit_many([(s, text, s.metadata) for s, text in zip(got, texts)])
        return self.count([r.key.group_id for r in self.rewards.poll()])


class Driver(Ingest):
    """Stage "driver": the orchestrator's per-turn work, on the real ledger, pool and router."""

    def __init__(self, receiver, args, rewards, tokenizer, tmp: Path, run: str = "run"):
        super().__init__(receiver, args)
        from asyncrl.config import load_config
        from asyncrl.observe.metrics import MetricsWriter
        from asyncrl.orchestrator import components
        from asyncrl.orchestrator.evaluation import Evaluator
        from asyncrl.orchestrator.intake import SampleIntake
        from asyncrl.orchestrator.orchestrator import BOOKKEEPING_S  # and so the driver's imports: its heap
        from asyncrl.orchestrator.scoring import ResultRouter
        from asyncrl.orchestrator.stage_runner import StageRunner
        from asyncrl.orchestrator.step_stats import StepStats
        from asyncrl.reward.errors import RewardErrorMonitor
        from asyncrl.rollout.engine import SamplingSpec

        self.cfg = cfg = load_config(None, [
            f"reward.type={VERIFIER}", f"rollout.group_size={args.group_size}", f"rollout.max_tokens={args.response_tokens}",
            f"buffer.token_budget={args.token_budget}", f"model.max_model_len={args.prompt_tokens + args.response_tokens + 64}",
            "eval.every_steps=0", "observe.tensorboard=false", f"observe.output_dir={tmp}"])
        self.stages = StageRunner(cfg, str(tmp))
        self.ledger = components.build_ledger(cfg, self.stages.current)
        self.stats = StepStats(cfg.observe.samples_per_step)
        metrics = MetricsWriter(tmp / run, tensorboard=False)
        evaluator = Evaluator.build(cfg, tokenizer, metrics, print)
        route = ResultRouter(self.ledger, self.stats, self.stages, evaluator, tokenizer,
                             RewardErrorMonitor(cfg.reward.max_error_frac), metrics, print)
        self.intake = SampleIntake(self.ledger, rewards, tokenizer, route, evaluator)
        self.rewards, self.spec, self.step = rewards, SamplingSpec(1.0, 1.0, args.response_tokens), 0
        self.prompt = [5] * args.prompt_tokens
        self.actor_ids = list(range(args.actors))
        self.next_bookkeeping, self.every = 0.0, BOOKKEEPING_S

    def grant(self, groups: list[tuple[int, int]]) -> None:
        super().grant(groups)
        for a, g in groups:  # admitted as the orchestrator admits a prompt for an actor
            self.ledger.admit(PromptItem(f"a{a}g{g}", self.prompt, metadata(g)), 0, self.spec, self.n, a)

    def turn(self) -> list[tuple[int, int]]:
        from asyncrl.buffer.packing import split_for_ranks
        from asyncrl.transport.codec import encode_batch
        from asyncrl.types import Batch

        self.intake.ingest(self.receiver.drain())
        now = time.monotonic()
        if now >= self.next_bookkeeping:  # the orchestrator's cadence for admission and the step
            self.next_bookkeeping = now + self.every
            self.ledger.capacity(0, self.cfg.buffer.token_budget, self.n, self.spec.max_tokens, step_running=True,
                                 verifiers_behind=self.rewards.num_queued > 0)
            self.ledger.generating_by_actor(self.actor_ids)
            buffer = self.ledger.buffer
            while (chunks := buffer.next_batch(0)) is not None:  # a learner that takes each batch at once
                self.step += 1
                self.stats.add_batch(chunks, 0, buffer.batch_start_version)
                for rank, part in enumerate(split_for_ranks(chunks, 1)):
                    encode_batch(Batch(self.step, rank, part, buffer.token_budget, len(chunks), buffer.token_budget))
                self.stats.flush(buffer, self.ledger.assembler, self.receiver)
        sample = self.receiver.recv(timeout_s=0.01)
        if sample is not None:
            self.intake.ingest([sample])
        results = self.intake.poll_rewards(self.step)
        done = {r.key.group_id for r in results} - self.ledger.records.keys()
        before = self.completed
        c = self.ledger.counts
        self.completed = c.samples_kept + c.samples_rejected
        assert self.completed - before == len(done) * self.n  # the ledger's accounting holds
        self.outstanding -= len(done)
        return [self.key[gid] for gid in done]


def measure(stage: Ingest, actors: Actors, collector, args, profile: str | None = None) -> tuple[float, float, float]:
    """Samples/s through `stage` over `args.seconds` after a second of warm-up, the driver
    process's CPU use in cores, and the whole machine's busy cores; then lets every granted group
    finish so the next stage starts with nothing in flight."""
    import psutil

    me = psutil.Process()
    groups = [(a, g) for a in range(args.actors) for g in range(args.groups_per_actor)]
    stage.grant(groups)
    actors.grant(groups)
    t_start, mark, spy = time.monotonic(), None, None
    while True:
        done = stage.turn()
        collector.maybe_collect()  # the orchestrator's loop does, every BOOKKEEPING_S
        now = time.monotonic()
        if mark is None and now - t_start >= 1.0:
            mark = (now, stage.completed, sum(me.cpu_times()[:2]))
            psutil.cpu_percent()
            if profile:
                spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "-d", str(int(args.seconds)),
                                        "-r", "200", "--format", "raw", "--nonblocking", "-o", profile],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if mark is not None and now - mark[0] >= args.seconds:
            break
        stage.grant(done)
        actors.grant(done)
    wall = now - mark[0]
    rate = (stage.completed - mark[1]) / wall
    driver_cores = (sum(me.cpu_times()[:2]) - mark[2]) / wall
    machine_cores = psutil.cpu_percent() / 100 * psutil.cpu_count()
    deadline = time.monotonic() + 60
    while stage.outstanding and time.monotonic() < deadline:
        stage.turn()
    if stage.outstanding:
        raise RuntimeError(f"{stage.outstanding} groups never completed")
    if spy is not None:
        spy.wait(60)
    return rate, driver_cores, machine_cores


def print_profile(path: str, top: int = 18) -> None:
    """The functions that took the driver's time (py-spy samples, self time, all threads)."""
    self_time: Counter = Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        self_time[stack.split(";")[-1]] += int(count)
    print(f"driver profile ({total} samples, self time):")
    for frame, count in self_time.most_common(top):
        print(f"  {count / total:6.1%}  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actors", type=int, default=64, help="simulated rollout actors")
    parser.add_argument("--hosts", type=int, default=4, help="processes the actors live in")
    parser.add_argument("--groups-per-actor", type=int, default=16, help="groups each actor generates at once")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (n)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=16)
    parser.add_argument("--gen-s", type=float, default=0.05, help="simulated generation time per sample (s)")
    parser.add_argument("--step-s", type=float, default=None,
                        help="simulated engine step (s): samples finish at step ends (default gen-s / response-tokens)")
    parser.add_argument("--token-budget", type=int, default=8192, help="Phi: loss tokens per batch")
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured time per stage and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", help="py-spy the driver during the first driver measurement into this file")
    args = parser.parse_args()
    if args.step_s is None:
        args.step_s = args.gen_s / args.response_tokens  # one decode step per token

    from asyncrl.orchestrator.components import build_reward_pool
    from asyncrl.orchestrator.collector import ScheduledCollector
    from asyncrl.config import RewardConfig
    from asyncrl.tiny.tokenizer import save_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-bench-orch-"))
    tokenizer = save_tokenizer(tmp)
    rewards = build_reward_pool(RewardConfig(type=VERIFIER, num_workers=args.reward_workers), set)
    rewards.wait_ready()
    receiver = FrameReceiver(decode_samples)
    actors = Actors(receiver.endpoint, args)
    stages = {"ingest": Ingest(receiver, args), "score": Score(receiver, args, rewards, tokenizer),
              "driver": Driver(receiver, args, rewards, tokenizer, tmp),
              "driver_actor_rewards": Driver(receiver, args, rewards, tokenizer, tmp, "run-actor-rewards")}
    collector = ScheduledCollector()  # as the orchestrator does at the end of its start-up
    collector.start()
    offered = args.actors * args.groups_per_actor * args.group_size / args.gen_s
    print(f"{args.actors} simulated actors in {args.hosts} processes, {args.groups_per_actor} groups of "
          f"{args.group_size} each at a time, {args.prompt_tokens}+{args.response_tokens} tokens a sample, "
          f"{args.gen_s * 1000:.0f} ms per sample: up to {offered:,.0f} samples/s offered; "
          f"{args.reward_workers} reward workers")
    rates: dict[str, list[float]] = {name: [] for name in ["raw", *stages]}
    try:
        for r in range(args.rounds):
            line, frames_before, records_before = "", receiver.num_frames, receiver.num_received
            for name, stage in stages.items():
                actors.with_rewards = name == "driver_actor_rewards"
                profile = f"{args.profile}.{name}" if (args.profile and name.startswith("driver") and r == 0) else None
                rate, driver_cores, machine_cores = measure(stage, actors, collector, args, profile)
                rates[name].append(rate)
                line += f" | {name} {rate:,.0f} (driver {driver_cores:.2f} cores, machine {machine_cores:.2f})"
            per_frame = (receiver.num_received - records_before) / (receiver.num_frames - frames_before)
            rates["raw"].append(raw_rate(args, args.seconds, max(1, round(per_frame))))
            print(f"round {r + 1}: {per_frame:.2f} samples a frame, raw {rates['raw'][-1]:,.0f}{line} samples/s",
                  flush=True)
    finally:
        actors.stop()
        rewards.close()
        collector.release()
    raw = statistics.median(rates["raw"])
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:<20} {med:10,.0f} samples/s (median of {len(values)}), {med / raw:5.2f} of raw")
    for name in ("driver", "driver_actor_rewards"):
        print(f"{name} accounting: {stages[name].ledger.accounting()}")
    print(f"garbage collector (scheduled, as the orchestrator's): {collector.num_collections} full collections, "
          f"{collector.total_s:.2f} s in all")
    if args.profile:
        for name in ("driver", "driver_actor_rewards"):
            print(f"{name}: ", end="")
            print_profile(f"{args.profile}.{name}")


if __name__ == "__main__":
    main()
