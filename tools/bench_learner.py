"""Benchmark the learner: optimizer steps/s and trained tokens/s for 1 vs 2 ranks per backend.

    python tools/bench_learner.py [--configs torch-1 torch-2 zero2-1 zero2-2 zero3-1 zero3-2]
                                  [--hidden 512 --layers 4 --budget 1024 --steps 3]

Every configuration runs real `LearnerRank`s in their own processes, joined in a gloo group
exactly as the orchestrator's ranks are (minus Ray), on the same locally built Llama model and
the same synthetic steps of Φ loss tokens (prompts of 64 tokens, responses of 96-160). Each
configuration gets the same cores in total: one rank uses `--cores` torch threads, each of two
ranks half of them. Warm-up steps are not timed; the ratio is against `torch-1` (the plain
single-rank learner) measured in the same run.

How to read it on a CPU machine: two ranks split the same cores, so they cannot be faster than
one rank; what the ratio shows is the price of sharding (FSDP2's per-layer all-gathers and
reduce-scatters, ZeRO's partitioned optimizer, the zero-loss micro-batches a rank runs to keep
in step) at equal compute. On a GPU node each rank brings its own GPU, the step's tokens are
split between them, and the same code scales the step instead.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import resource
import tempfile
import time
from pathlib import Path

CONFIGS = {"torch-1": ("torch", 2, 1), "torch-2": ("torch", 2, 2), "zero2-1": ("deepspeed", 2, 1),
           "zero2-2": ("deepspeed", 2, 2), "zero3-1": ("deepspeed", 3, 1), "zero3-2": ("deepspeed", 3, 2)}


def build_model(path: Path, hidden: int, layers: int) -> int:
    """A seeded Llama with the tiny char tokenizer, saved to `path`; returns its parameter count."""
    from asyncrl.compat import hide_broken_torch_extras

    hide_broken_torch_extras()  # before transformers: a .[cpu] venv's torchvision breaks its imports
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.tiny.tokenizer import save_tokenizer

    vocab = len(save_tokenizer(path))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                         num_key_value_heads=hidden // 128, max_position_embeddings=512))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def step_chunks(step: int, budget: int):
    """Responses until exactly `budget` loss tokens (the buffer's Φ), the last one cut."""
    from asyncrl.types import SequenceChunk

    rng, out, total = random.Random(step), [], 0
    while total < budget:
        n = min(rng.randrange(96, 161), budget - total)
        out.append(SequenceChunk(f"g{len(out)}", 0, [rng.randrange(4, 90) for _ in range(64)],
                                 [rng.randrange(4, 90) for _ in range(n)], 0, [-2.0] * n, [step - 1] * n,
                                 advantage=rng.uniform(-1, 1)))
        total += n
    return out


def rank_main(rank: int, world: int, port: int, args, config: str, out: str) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    from asyncrl.buffer.packing import split_for_ranks
    from asyncrl.config import AlgoConfig, LearnerConfig
    from asyncrl.learner.rank import LearnerRank
    from asyncrl.transport.codec import encode_batch
    from asyncrl.transport.zmq_stream import FrameSender
    from asyncrl.types import Batch

    backend, stage, _ = CONFIGS[config]
    cfg = LearnerConfig(backend=backend, num_ranks=world, deepspeed={"stage": stage}, num_threads=args.cores // world,
                        micro_batch_tokens=args.micro_batch_tokens)
    learner = LearnerRank(args.model, cfg, AlgoConfig(), rank=rank, world_size=world, group_address=f"127.0.0.1:{port}")
    sender = FrameSender(learner.batch_endpoint())
    times, tokens = [], 0
    for step in range(1, args.warmup + args.steps + 1):
        chunks = step_chunks(step, args.budget)
        sender.send(encode_batch(Batch(step=step, rank=rank, chunks=split_for_ranks(chunks, world)[rank],
                                       num_loss_tokens_global=args.budget, num_sequences_global=len(chunks),
                                       token_budget=args.budget)))
        t0 = time.perf_counter()
        learner.train_step(step)
        if step > args.warmup:
            times.append(time.perf_counter() - t0)
            tokens += sum(c.num_tokens for c in chunks)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(f"{out}.{rank}").write_text(json.dumps({"times": times, "tokens": tokens, "rss_mib": rss}))
    sender.close()
    learner.shutdown()


def run_config(args, config: str, tmp: Path) -> dict:
    from asyncrl.sync.wire import free_port

    world = CONFIGS[config][2]
    out, ctx, port = str(tmp / config), mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, config, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=1800)
    if any(p.exitcode != 0 for p in procs):
        return {"config": config, "error": f"rank exit codes {[p.exitcode for p in procs]}"}
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    seconds = sum(ranks[0]["times"])
    return {"config": config, "ranks": world, "steps_per_s": len(ranks[0]["times"]) / seconds,
            "loss_tokens_per_s": args.budget * len(ranks[0]["times"]) / seconds,
            "forward_tokens_per_s": ranks[0]["tokens"] / seconds,
            "peak_rss_mib_per_rank": [round(r["rss_mib"]) for r in ranks]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget", type=int, default=1024, help="Φ: loss tokens per optimizer step")
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="torch threads in total, per config")
    p.add_argument("--model", help="a Hugging Face model directory (default: build one)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(Path(tmp) / "model")
            n = build_model(Path(args.model), args.hidden, args.layers)
            print(f"model: Llama, hidden {args.hidden}, {args.layers} layers, {n / 1e6:.1f}M parameters, float32")
        print(f"Φ = {args.budget} loss tokens a step, {args.cores} torch threads per configuration in total "
              f"(one rank: {args.cores}; two ranks: {args.cores // 2} each); {args.warmup} warm-up + {args.steps} "
              "timed steps", flush=True)
        results = []
        for config in args.configs:
            print(f"running {config} ...", flush=True)
            results.append(run_config(args, config, Path(tmp)))
    base = next((r for r in results if r["config"] == "torch-1" and "error" not in r), None)
    print(f"\n{'config':<9} {'ranks':>5} {'steps/s':>8} {'loss tok/s':>11} {'fwd tok/s':>10} {'vs torch-1':>10}  "
          "peak RSS MiB/rank")
    for r in results:
        if "error" in r:
            print(f"{r['config']:<9} failed: {r['error']}")
            continue
        ratio = f"{r['steps_per_s'] / base['steps_per_s']:.2f}x" if base else "-"
        print(f"{r['config']:<9} {r['ranks']:>5} {r['steps_per_s']:>8.3f} {r['loss_tokens_per_s']:>11,.0f} "
              f"{r['forward_tokens_per_s']:>10,.0f} {ratio:>10}  {r['peak_rss_mib_per_rank']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
