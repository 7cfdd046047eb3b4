"""Simulated rollout actors: many in one process, no engine and no CPU spent generating, each with
its own zmq PUSH socket as every RolloutActor has, sending real sample frames.

For measuring the driver alone (tools/bench_orchestrator.py): a granted group's samples finish
`gen_s` (x 0.5-1.5) after the grant, at the end of their actor's engine step (`step_s`: an engine
hands out the requests that finished in one step together), and the samples that finished
together go in one frame with the real codec, as RolloutActor's RecordBatcher sends them. Samples
(and, for actor-scored runs, their rewards) are built beforehand: on a cluster that is the actor
nodes' work, not the driver's. Grants travel as zmq messages (the stand-in for
`RolloutActor.submit`): `(scored?, [(actor, group), ...])`, where `group` is a slot `g` (its samples
have the id `a<a>g<g>`) or a group id the driver's admission chose (the actor's next slot's samples
go out under that id).
"""

from __future__ import annotations

import heapq
import math
import multiprocessing as mp
import random
import time
from dataclasses import dataclass, replace

import msgpack
import zmq

from asyncrl.transport.codec import encode_samples
from asyncrl.transport.zmq_stream import FrameSender
from asyncrl.types import Sample

VERIFIER = "import:asyncrl.reward.fault_injection:by_response_hash"  # a crc32: rewards mixed in a group


@dataclass(frozen=True)
class Workload:
    """What the simulated actors generate."""

    actors: int = 64
    hosts: int = 4
    """Processes the actors live in."""
    groups_per_actor: int = 16
    group_size: int = 8
    prompt_tokens: int = 16
    response_tokens: int = 16
    gen_s: float = 0.05
    """Generation time of a sample (s)."""
    step_s: float = 0.05 / 16
    """Engine step (s): samples finish at step ends (one decode step a token); 0: when they are done."""


def metadata(group: int) -> dict:
    return {"answer": "12", "data_source": "tiny_arith", "record_key": f"tiny_arith/{group}"}


def group_samples(actor: int, group: int, args: Workload, rng: random.Random) -> list[Sample]:
    """The n samples of one group as a RolloutActor sends them (token ids of the tiny model)."""
    gid, r = f"a{actor}g{group}", args.response_tokens
    prompt = [rng.randrange(3, 98) for _ in range(args.prompt_tokens)]
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


def actor_host(endpoint: str, grants_endpoint: str, actors: list[int], args: Workload) -> None:
    """Many simulated actors in one process; grants arrive as (scored?, [(actor, group)])."""
    from asyncrl.tiny.tokenizer import build_tokenizer

    rng, tokenizer = random.Random(actors[0]), build_tokenizer()
    plain = {(a, g): group_samples(a, g, args, rng) for a in actors for g in range(args.groups_per_actor)}
    with_rewards = {key: [scored(s, tokenizer) for s in group] for key, group in plain.items()}
    phase = {a: rng.random() * args.step_s for a in actors}  # the actors' steps are not in lockstep
    # a group id the driver admitted -> the free slot whose samples go out under it (renamed in
    # place: a copy per sample would cost these processes the cores the driver is measured on)
    named: dict[tuple[int, str], tuple[int, int]] = {}  # (actor, id) -> (slot, samples not yet sent)
    free = {a: list(range(args.groups_per_actor)) for a in actors}
    sockets = {a: FrameSender(endpoint) for a in actors}
    grants = zmq.Context.instance().socket(zmq.PULL)
    grants.connect(grants_endpoint)
    due: list[tuple[float, int, int | str, int, bool]] = []  # (when, actor, group, sample index, scored)
    while True:
        wait_ms = max(0.0, due[0][0] - time.monotonic()) * 1000 if due else 100
        while grants.poll(wait_ms):
            wait_ms, msg = 0, msgpack.unpackb(grants.recv())
            if msg is None:
                return
            now, (by_actor, pairs) = time.monotonic(), msg
            for a, g in pairs:
                if isinstance(g, str):  # a group the driver admitted (at most groups_per_actor at a time)
                    slot = free[a].pop()
                    named[a, g] = (slot, args.group_size)
                    for x in (with_rewards if by_actor else plain)[a, slot]:
                        x.group_id = x.prompt_id = g
                for i in range(args.group_size):
                    t = now + args.gen_s * (0.5 + rng.random())
                    t = phase[a] + math.ceil((t - phase[a]) / args.step_s) * args.step_s if args.step_s else t
                    heapq.heappush(due, (t, a, g, i, by_actor))
        now, finished = time.monotonic(), {}
        while due and due[0][0] <= now:
            _, a, g, i, by_actor = heapq.heappop(due)
            if isinstance(g, str):
                slot, left = named.pop((a, g))
                finished.setdefault(a, []).append((with_rewards if by_actor else plain)[a, slot][i])
                if left > 1:
                    named[a, g] = (slot, left - 1)
                else:
                    free[a].append(slot)
            else:
                finished.setdefault(a, []).append((with_rewards if by_actor else plain)[a, g][i])
        for a, samples in finished.items():
            sockets[a].send(encode_samples(samples))


class SimulatedActors:
    """The simulated actors' processes, sending to `endpoint`, and the grant sockets to them."""

    def __init__(self, endpoint: str, args: Workload):
        ctx, per = zmq.Context.instance(), -(-args.actors // args.hosts)
        self.host_of, self.sockets, self.procs, self.with_rewards = {}, [], [], False
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
        """Generate these (actor, group) pairs (again); scored by the actors if `with_rewards`."""
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


