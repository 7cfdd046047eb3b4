"""One rollout actor streaming samples vs a bare `vllm.LLM.generate` of the same engine.

    python tools/bench_actor.py [--prompts 256] [--rounds 3] [section.field=value ...]

Both run as Ray actors with the same logical CPUs, on the run's model (default: the tiny
model), the same engine arguments (`VLLMEngine.engine_kwargs`), prompts, group size,
temperature, max_tokens and one logprob per token, in alternating rounds (never at once: they
would share the cores):
- bare: `LLM.generate(prompts, SamplingParams(n=group_size, ...))`, vLLM's offline batch API,
  which is how a vLLM user generates a batch as fast as the engine can, in vLLM's own process
  layout (on CPU the actor's engine runs its model worker inside the engine-core process instead,
  `one_engine_process_on_cpu` in rollout/vllm_engine.py: it starts faster at the same tokens/s);
- actor: `RolloutActor.submit` of the same prompts, every sample streamed over zmq+msgpack to
  this process as it finishes and decoded here, timed until the last one arrives.

Both engines start first; after one warm-up round each, `--rounds` timed rounds alternate
between them, and the medians are compared. Prints tokens/s and samples/s and the ratio actor / bare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import ray

from asyncrl.compat import child_env, hide_broken_torch_extras
from asyncrl.config import load_config
from asyncrl.lab.offline.eval_policy import prompt_items, train_records
from asyncrl.preflight import resolve


class BareVLLM:
    """`vllm.LLM` with the actor engine's arguments; `generate` returns (tokens, samples)."""

    def __init__(self, engine_kwargs: dict, kv_cache_gib: int):
        import os

        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        hide_broken_torch_extras()
        from vllm import LLM

        self.llm = LLM(**engine_kwargs)

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: int) -> tuple[int, int]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                seed=seed, logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seqs = [s for o in outs for s in o.outputs]
        return sum(len(s.token_ids) for s in seqs), len(seqs)


class Sides:
    """Both engines started side by side (an idle engine costs no CPU), timed in alternation so
    a busy machine slows both alike."""

    def __init__(self, cfg, model_path: str, engine_kwargs: dict, items: list):
        from asyncrl.orchestrator.components import start_rollout_actor
        from asyncrl.transport.codec import decode_samples
        from asyncrl.transport.zmq_stream import FrameReceiver

        self.cfg, self.items = cfg, items
        self.bare = ray.remote(BareVLLM).options(
            num_cpus=cfg.rollout.num_cpus_per_actor, runtime_env={"env_vars": child_env()},
        ).remote(engine_kwargs, cfg.rollout.kv_cache_gib)
        self.receiver = FrameReceiver(decode_samples)
        self.actor = start_rollout_actor(cfg, model_path, self.receiver.endpoint, actor_id=0)
        ray.get(self.actor.start.remote())

    def time_bare(self, round_: int) -> dict:
        r = self.cfg.rollout
        t0 = time.monotonic()
        tokens, samples = ray.get(self.bare.generate.remote(
            [p.prompt_ids for p in self.items], r.group_size, r.temperature, r.top_p, r.max_tokens,
            self.cfg.seed + round_))
        return {"s": time.monotonic() - t0, "tokens": tokens, "samples": samples}

    def time_actor(self, round_: int) -> dict:
        batch = [replace(p, prompt_id=f"r{round_}-{p.prompt_id}") for p in self.items]  # request ids stay unique
        expected = len(batch) * self.cfg.rollout.group_size
        t0 = time.monotonic()
        self.actor.submit.remote(batch)
        tokens = samples = 0
        while samples < expected:
            s = self.receiver.recv(timeout_s=120.0)
            if s is None:
                raise RuntimeError(f"round {round_}: {samples}/{expected} samples after 120 s")
            tokens, samples = tokens + len(s.response_ids), samples + 1
        return {"s": time.monotonic() - t0, "tokens": tokens, "samples": samples}

    def close(self) -> None:
        ray.kill(self.bare)
        ray.kill(self.actor)
        self.receiver.close()


def summary(rounds: list[dict]) -> dict:
    tok = statistics.median(r["tokens"] / r["s"] for r in rounds)
    smp = statistics.median(r["samples"] / r["s"] for r in rounds)
    return {"tokens_per_s": tok, "samples_per_s": smp, "rounds": rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=256, help="prompts per round (each sampled group_size times)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    p.add_argument("overrides", nargs="*", help="config overrides, as for `asyncrl run`")
    args = p.parse_args()
    hide_broken_torch_extras()
    from transformers import AutoTokenizer

    from asyncrl.orchestrator.components import resolve_model_path
    from asyncrl.rollout import engine_factory

    cfg = resolve(load_config(None, [*args.overrides, "observe.worker_logs=console"]))
    model_path = resolve_model_path(cfg, log=print)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    records = train_records(cfg)
    items = prompt_items(cfg, tokenizer, [records[i % len(records)] for i in range(args.prompts)],
                         cfg.rollout.max_tokens)
    engine_kwargs = engine_factory(cfg, model_path, actor_id=0)().engine_kwargs()
    ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        sides = Sides(cfg, model_path, engine_kwargs, items)
        rounds = {"bare": [], "actor": []}
        for i in range(args.rounds + 1):  # round 0 warms both up
            for name in rounds:
                result = getattr(sides, f"time_{name}")(i)
                if i:
                    rounds[name].append(result)
        sides.close()
        bare, actor = summary(rounds["bare"]), summary(rounds["actor"])
    finally:
        ray.shutdown()
    print(f"{len(items)} prompts x {cfg.rollout.group_size} samples, max_tokens {cfg.rollout.max_tokens}, "
          f"warm median of {args.rounds} rounds")
    print(f"{'':<8}{'tokens/s':>12}{'samples/s':>12}")
    for name, r in (("bare", bare), ("actor", actor)):
        print(f"{name:<8}{r['tokens_per_s']:>12,.0f}{r['samples_per_s']:>12,.0f}")
    ratio = actor["tokens_per_s"] / bare["tokens_per_s"]
    print(f"actor / bare vLLM tokens/s: {ratio:.2f}x")
    print(json.dumps({"bare": bare, "actor": actor, "ratio": ratio}))


if __name__ == "__main__":
    main()
