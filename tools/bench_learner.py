"""Benchmark the learner: optimizer steps/s and trained tokens/s per backend, rank count, model
shape, length distribution and learner settings.

    python tools/bench_learner.py [--configs torch-1 torch-2 zero2-1 zero2-2 zero3-1 zero3-2]
                                  [--shape tiny|llama|qwen2.5-0.5b|qwen2.5-1.5b|qwen3-4b] [--lengths fixed|rl]
                                  [--variants before packed one-pass-head] [--rounds 2]
                                  [--activation-checkpointing] [--checkpoint]
                                  [--variants baseline packed --baseline-src DIR]
                                  [--budget 1024 --steps 3]

Every configuration runs real `LearnerRank`s in their own processes, joined in a gloo group
exactly as the orchestrator's ranks are (minus Ray), on the same locally built model (random
weights, seeded; `--shape` copies a real model's config.json values) and the same synthetic
steps of Φ loss tokens. `--lengths fixed`: prompts of 64 tokens, responses of 96-160; `rl`:
prompts of 64-256, responses lognormal with mean 400, capped at 1,024 (a spread of lengths as
RL makes, which padding pays for). Each configuration gets the same cores in total: one rank
uses `--cores` torch threads, each of two ranks half of them. Warm-up steps are not timed.

`--variants` are settings of the same learner, each run in every round, in alternating order:
`before`: the learner as it was before packing and the one-pass head (padded micro-batches, the
head recomputed in backward: learner.pack_sequences=false); `packed`: the default config (packed
micro-batches, learner/collate.py); `one-pass-head`: packed and learner.recompute_head=false, as
the GPU recipes run; `baseline`: another commit's learner with that commit's defaults, from a
checkout of it (`--baseline-src`, e.g. `git worktree add ../base COMMIT`): the honest "before",
every other change of the learner included. Each variant's loss tokens/s is printed against
`baseline`'s when it ran, else `before`'s: a baseline measured in the same run. The last line is
JSON: tokens_per_s (loss tokens), padding_frac, peak_rss_gib_per_rank, ranks and shape of the
first configuration's last variant; `vs_before` / `vs_baseline` (each variant's ratio, and its
rounds) when that variant ran; `peak_rss_two_vs_one_rank` when one and two ranks of a backend ran
(the busier rank's peak over the one rank's, on the same steps; the table also prints each rank's
resident memory between steps); and with `--checkpoint` what the
checkpoint check found: a save after the timed steps, two steps more, and the same two again on
fresh ranks resumed from the save (`resumed_loss_equal`: the second step's parameters came from
an update with the restored Adam moments), with each rank's growth of peak memory during the
save against the size of the whole optimizer state.

How to read two ranks on a CPU machine: they split the same cores, so they cannot be faster than
one rank; what the ratio shows is the price of sharding (FSDP2's per-layer all-gathers and
reduce-scatters, ZeRO's partitioned optimizer, the zero-loss micro-batches a rank runs to keep
in step) at equal compute. On a GPU node each rank brings its own GPU, the step's tokens are
split between them, and the same code scales the step instead.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"torch-1": ("torch", 2, 1), "torch-2": ("torch", 2, 2), "zero2-1": ("deepspeed", 2, 1),
           "zero2-2": ("deepspeed", 2, 2), "zero3-1": ("deepspeed", 3, 1), "zero3-2": ("deepspeed", 3, 2)}


# config.json values of the models the recipes name (hidden, MLP, layers, heads, KV heads, head dim,
# vocabulary, tied embeddings); `tiny` is small enough for a CI smoke run, `llama` is --hidden/--layers
SHAPES = {
    "tiny": dict(family="qwen2", hidden=128, mlp=512, layers=2, heads=4, kv=2, head_dim=32, vocab=None, tied=True),
    "qwen2.5-0.5b": dict(family="qwen2", hidden=896, mlp=4864, layers=24, heads=14, kv=2, head_dim=64, vocab=151936,
                         tied=True),
    "qwen2.5-1.5b": dict(family="qwen2", hidden=1536, mlp=8960, layers=28, heads=12, kv=2, head_dim=128, vocab=151936,
                         tied=True),
    "qwen3-4b": dict(family="qwen3", hidden=2560, mlp=9728, layers=36, heads=32, kv=8, head_dim=128, vocab=151936,
                     tied=True),
}


def hf_model(shape: str, vocab: int, hidden: int = 512, layers: int = 4):
    """A seeded, randomly initialised Hugging Face model of `shape` (SHAPES; llama: `hidden` and
    `layers`), on the current default device. A shape without a vocabulary takes `vocab`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if shape == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                            num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                            num_key_value_heads=hidden // 128, max_position_embeddings=2048))
    s = SHAPES[shape]
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        s["family"]]
    return model_cls(config_cls(vocab_size=s["vocab"] or vocab, hidden_size=s["hidden"], intermediate_size=s["mlp"],
                                num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                num_key_value_heads=s["kv"], head_dim=s["head_dim"], tie_word_embeddings=s["tied"],
                                max_position_embeddings=40960, rope_theta=1_000_000.0))


def build_model(path: Path, shape: str, hidden: int, layers: int) -> int:
    """`hf_model` with the tiny char tokenizer, saved to `path`; returns its parameter count. A
    real shape's vocabulary is kept (the head's cost is the vocabulary's), though the synthetic
    token ids stay in the tokenizer's range."""
    from asyncrl.compat import hide_broken_torch_extras

    hide_broken_torch_extras()  # before transformers: a .[cpu] venv's torchvision breaks its imports
    from asyncrl.tiny.tokenizer import save_tokenizer

    model = hf_model(shape, len(save_tokenizer(path)), hidden, layers)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def lengths(rng: random.Random, kind: str) -> tuple[int, int]:
    """(prompt, response) token counts of one synthetic sample (module docstring)."""
    if kind == "fixed":
        return 64, rng.randrange(96, 161)
    sigma = 0.8  # lognormal: mean exp(mu + sigma^2 / 2) = 400
    return rng.randrange(64, 257), max(1, min(1024, round(rng.lognormvariate(math.log(400) - sigma ** 2 / 2, sigma))))


def step_chunks(step: int, budget: int, kind: str = "fixed"):
    """Responses until exactly `budget` loss tokens (the buffer's Φ), the last one cut."""
    from asyncrl.types import SequenceChunk

    rng, out, total = random.Random(step), [], 0
    while total < budget:
        prompt, response = lengths(rng, kind)
        n = min(response, budget - total)
        out.append(SequenceChunk(f"g{len(out)}", 0, [rng.randrange(4, 90) for _ in range(prompt)],
                                 [rng.randrange(4, 90) for _ in range(n)], 0, [-2.0] * n, [step - 1] * n,
                                 advantage=rng.uniform(-1, 1)))
        total += n
    return out


VARIANTS = {"before": dict(pack_sequences=False, recompute_head=True),
            "packed": dict(pack_sequences=True, recompute_head=True),
            "one-pass-head": dict(pack_sequences=True, recompute_head=False),
            "baseline": {}}  # --baseline-src's learner, with that commit's defaults


def rank_main(rank: int, world: int, port: int, args, config: str, variant: str, out: str,
              resume: str | None = None) -> None:
    """One rank's timed steps (then, with --checkpoint, a checkpoint and two steps more); `resume`:
    instead, a fresh rank resumes that checkpoint and runs the step after it."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from asyncrl.buffer.packing import split_for_ranks
    from asyncrl.config import AlgoConfig, LearnerConfig
    from asyncrl.learner.rank import LearnerRank
    from asyncrl.transport.codec import encode_batch
    from asyncrl.transport.zmq_stream import FrameSender
    from asyncrl.types import Batch

    backend, stage, _ = CONFIGS[config]
    fields = dict(backend=backend, num_ranks=world, deepspeed={"stage": stage}, num_threads=args.cores // world,
                  micro_batch_tokens=args.micro_batch_tokens, activation_checkpointing=args.activation_checkpointing,
                  **VARIANTS[variant])
    # another commit's learner (--baseline-src) may not know this one's newer fields: they are left out
    cfg = LearnerConfig(**{k: v for k, v in fields.items() if k in LearnerConfig.model_fields})
    learner = LearnerRank(f"{resume}/policy" if resume else args.model, cfg, AlgoConfig(), rank=rank,
                          world_size=world, group_address=f"127.0.0.1:{port}")
    sender = FrameSender(learner.batch_endpoint())

    def train(step: int):
        chunks = step_chunks(step, args.budget, args.lengths)
        sender.send(encode_batch(Batch(step=step, rank=rank, chunks=split_for_ranks(chunks, world)[rank],
                                       num_loss_tokens_global=args.budget, num_sequences_global=len(chunks),
                                       token_budget=args.budget)))
        return chunks, learner.train_step(step)

    def after(last: int) -> list[float]:
        """The losses of the two steps after `last`: the second's parameters come from an update
        that used the optimizer's moments, which a checkpoint must have kept."""
        return [train(step)[1].metrics["loss/total"] for step in (last + 1, last + 2)]

    last = args.warmup + args.steps
    if resume:
        learner.load_checkpoint(resume)
        Path(f"{out}.{rank}").write_text(json.dumps({"loss_after": after(last)}))
        sender.close()
        learner.shutdown()
        return
    times, tokens, padding = [], 0, []
    for step in range(1, last + 1):
        t0 = time.perf_counter()
        chunks, result = train(step)
        if step > args.warmup:
            times.append(time.perf_counter() - t0)
            tokens += sum(c.num_tokens for c in chunks)
            padding.append(result.metrics.get("learner/padding_frac"))  # absent before the metric was
    known = [x for x in padding if x is not None]
    import asyncrl

    doc = {"times": times, "tokens": tokens, "rss_mib": peak_rss_mib(), "rss_now_mib": rss_now_mib(),
           "src": str(Path(asyncrl.__file__).parents[1]),
           "padding_frac": sum(known) / len(known) if known else None}
    if args.checkpoint:
        t0 = time.perf_counter()
        learner.save_checkpoint(f"{out}-ckpt")
        # the high-water mark: it rises only if saving needed more than any step did
        doc.update(save_s=time.perf_counter() - t0, save_rss_growth_mib=peak_rss_mib() - doc["rss_mib"],
                   loss_after=after(last))
    Path(f"{out}.{rank}").write_text(json.dumps(doc))
    sender.close()
    learner.shutdown()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_now_mib() -> float:
    """Resident memory now (Linux): after the last step, what the rank holds between steps."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def spawn_ranks(world: int, target, *args) -> list[int]:
    """`target(rank, world, port, *args)` in `world` processes, one gloo group; their exit codes."""
    from asyncrl.sync.wire import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=1800)
    return [p.exitcode for p in procs]


def checkpoint_check(args, config: str, variant: str, out: str, ranks: list[dict]) -> dict:
    """The checkpoint the ranks wrote: its files, how much the save raised each rank's peak
    memory against the optimizer state it would take whole, and the two steps after it resumed
    by fresh ranks against the same steps uninterrupted."""
    world, ckpt = CONFIGS[config][2], Path(f"{out}-ckpt")
    codes = spawn_ranks(world, rank_main, args, config, variant, f"{out}-resumed", str(ckpt))
    if any(codes):
        return {"error": f"resumed rank exit codes {codes}"}
    resumed = json.loads(Path(f"{out}-resumed.0").read_text())["loss_after"]
    from asyncrl.learner.sharded_load import file_shapes

    params = sum(math.prod(shape) for shape, _ in file_shapes(str(ckpt / "policy")).values())
    return {"save_s": max(r["save_s"] for r in ranks),
            "save_rss_growth_mib": [round(r["save_rss_growth_mib"]) for r in ranks],
            "full_optimizer_state_mib": round(2 * 4 * params / 2 ** 20),
            "state_files_mib": {f.name: round(f.stat().st_size / 2 ** 20, 1)
                                for f in sorted((ckpt / "state").iterdir())},
            "learner_pt_kib": round((ckpt / "learner.pt").stat().st_size / 1024, 1),
            "loss_after_uninterrupted": ranks[0]["loss_after"], "loss_after_resumed": resumed,
            "resumed_loss_equal": resumed == ranks[0]["loss_after"]}


def run_config(args, config: str, variant: str, tmp: Path) -> dict:
    world = CONFIGS[config][2]
    out = str(tmp / f"{config}-{variant}")
    if variant == "baseline":  # the ranks import asyncrl from that checkout: spawned children get this sys.path
        sys.path.insert(0, args.baseline_src)
    try:
        codes = spawn_ranks(world, rank_main, args, config, variant, out)
    finally:
        if variant == "baseline":
            sys.path.remove(args.baseline_src)
    if any(codes):
        return {"config": config, "variant": variant, "error": f"rank exit codes {codes}"}
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    seconds = sum(ranks[0]["times"])
    result = {"config": config, "variant": variant, "ranks": world, "seconds": seconds,
              "steps": len(ranks[0]["times"]), "tokens": ranks[0]["tokens"], "padding_frac": ranks[0]["padding_frac"],
              "peak_rss_mib_per_rank": [round(r["rss_mib"]) for r in ranks],
              "rss_between_steps_mib_per_rank": [round(r["rss_now_mib"]) for r in ranks], "src": ranks[0]["src"]}
    if args.checkpoint:
        result["checkpoint"] = checkpoint_check(args, config, variant, out, ranks)
    return result


def pooled(runs: list[dict], budget: int) -> dict:
    """One configuration and variant over its rounds: rates from the summed times, the highest RSS."""
    seconds, steps = sum(r["seconds"] for r in runs), sum(r["steps"] for r in runs)
    first = runs[0]
    return {"config": first["config"], "variant": first["variant"], "ranks": first["ranks"],
            "steps_per_s": steps / seconds, "loss_tokens_per_s": budget * steps / seconds,
            "forward_tokens_per_s": sum(r["tokens"] for r in runs) / seconds, "padding_frac": first["padding_frac"],
            "peak_rss_mib_per_rank": [max(r["peak_rss_mib_per_rank"][i] for r in runs) for i in range(first["ranks"])],
            "rss_between_steps_mib_per_rank": runs[-1]["rss_between_steps_mib_per_rank"],
            "round_loss_tokens_per_s": [budget * r["steps"] / r["seconds"] for r in runs],
            "src": first["src"], **({"checkpoint": runs[-1]["checkpoint"]} if "checkpoint" in runs[-1] else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--shape", default="llama", choices=["llama", *SHAPES],
                   help="the model's shape (random weights); llama: --hidden and --layers")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lengths", default="fixed", choices=["fixed", "rl"], help="prompt and response lengths")
    p.add_argument("--variants", nargs="+", default=["packed"], choices=list(VARIANTS),
                   help="learner settings, each run in every round (module docstring)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over the configurations and variants, alternated")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="learner.activation_checkpointing in every variant (a larger shape's memory)")
    p.add_argument("--budget", type=int, default=1024, help="Φ: loss tokens per optimizer step")
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="torch threads in total, per config")
    p.add_argument("--model", help="a Hugging Face model directory (default: build one of --shape)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--baseline-src", help="a checkout of another asyncrl commit (git worktree add DIR COMMIT): "
                                          "the variant `baseline` runs these steps on that commit's learner")
    p.add_argument("--checkpoint", action="store_true",
                   help="after the timed steps each configuration saves a checkpoint, and fresh ranks resume it: "
                        "its files, the save's memory, the resumed step's loss against the uninterrupted one")
    args = p.parse_args()
    if ("baseline" in args.variants) != bool(args.baseline_src):
        p.error("the variant `baseline` and --baseline-src go together")
    if args.baseline_src:
        args.baseline_src = str(Path(args.baseline_src).resolve())
        if not (Path(args.baseline_src) / "asyncrl" / "learner" / "rank.py").is_file():
            p.error(f"--baseline-src {args.baseline_src}: not an asyncrl checkout")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(Path(tmp) / "model")
            n = build_model(Path(args.model), args.shape, args.hidden, args.layers)
            print(f"model: {args.shape} shape, random weights, {n / 1e6:.1f}M parameters, float32")
        print(f"Φ = {args.budget} loss tokens a step, {args.lengths} lengths, {args.cores} torch threads per "
              f"configuration in total (one rank: {args.cores}; two ranks: {args.cores // 2} each); "
              f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} round(s)", flush=True)
        runs: dict[tuple[str, str], list[dict]] = {}
        for i in range(args.rounds):
            for config in args.configs:
                variants = args.variants if i % 2 == 0 else args.variants[::-1]  # neither side always first
                for variant in variants:
                    print(f"round {i + 1}: {config} {variant} ...", flush=True)
                    runs.setdefault((config, variant), []).append(run_config(args, config, variant, Path(tmp)))
    results = [pooled(r, args.budget) if all("error" not in x for x in r) else
               next(x for x in r if "error" in x) for r in runs.values()]
    against = "baseline" if args.baseline_src else "before"  # what each variant's ratio is against
    print(f"\n{'config':<9} {'variant':<13} {'ranks':>5} {'steps/s':>8} {'loss tok/s':>11} {'fwd tok/s':>10} "
          f"{'padding':>8} {'vs ' + against:>11}  peak RSS MiB/rank")
    for r in results:
        if "error" in r:
            print(f"{r['config']:<9} {r['variant']:<13} failed: {r['error']}")
            continue
        ref = next((b for b in results if b["config"] == r["config"] and b["variant"] == against
                    and "error" not in b), None)
        ratio = f"{r['loss_tokens_per_s'] / ref['loss_tokens_per_s']:.2f}x" if ref else "-"
        padding = "-" if r["padding_frac"] is None else f"{r['padding_frac']:.3f}"
        print(f"{r['config']:<9} {r['variant']:<13} {r['ranks']:>5} {r['steps_per_s']:>8.3f} "
              f"{r['loss_tokens_per_s']:>11,.0f} {r['forward_tokens_per_s']:>10,.0f} {padding:>8} "
              f"{ratio:>11}  {r['peak_rss_mib_per_rank']}")
    ok = [r for r in results if "error" not in r]
    for r in ok:
        if "checkpoint" in r:
            print(f"checkpoint of {r['config']} {r['variant']}: {json.dumps(r['checkpoint'])}")
    rss_two_vs_one = {}
    for one in (r for r in ok if r["ranks"] == 1):  # the same step on two ranks of the same backend
        two = next((r for r in ok if r["ranks"] == 2 and r["variant"] == one["variant"]
                    and CONFIGS[r["config"]][:2] == CONFIGS[one["config"]][:2]), None)
        if two:
            ratio = max(two["peak_rss_mib_per_rank"]) / one["peak_rss_mib_per_rank"][0]
            between = max(two["rss_between_steps_mib_per_rank"]) / one["rss_between_steps_mib_per_rank"][0]
            rss_two_vs_one[f"{two['config']}/{one['config']} {one['variant']}"] = ratio
            print(f"peak RSS per rank, {two['config']} against {one['config']} ({one['variant']}): {ratio:.2f}x; "
                  f"between steps {two['rss_between_steps_mib_per_rank']} against "
                  f"{one['rss_between_steps_mib_per_rank']} MiB: {between:.2f}x")
    summary = {}
    if ok:
        mine = [r for r in ok if r["config"] == ok[0]["config"]]
        last = mine[-1]
        summary = {"tokens_per_s": last["loss_tokens_per_s"], "padding_frac": last["padding_frac"],
                   "peak_rss_gib_per_rank": [m / 1024 for m in last["peak_rss_mib_per_rank"]],
                   "ranks": last["ranks"], "shape": args.shape, "lengths": args.lengths, "variant": last["variant"]}
        if rss_two_vs_one:
            summary["peak_rss_two_vs_one_rank"] = rss_two_vs_one
        if "checkpoint" in last:
            summary["checkpoint"] = last["checkpoint"]
        for name in ("before", "baseline"):
            ref = next((r for r in mine if r["variant"] == name), None)
            if ref:
                summary[f"vs_{name}"] = {r["variant"]: r["loss_tokens_per_s"] / ref["loss_tokens_per_s"] for r in mine}
                summary[f"rounds_vs_{name}"] = {r["variant"]: r["round_loss_tokens_per_s"] for r in mine}
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "summary": summary}, indent=2))
    print(json.dumps(summary))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
