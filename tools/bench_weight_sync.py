"""Benchmark the gloo weight push against a raw gloo broadcast of the same bytes (loopback).

    python tools/bench_weight_sync.py --size-mb 200 [--bucket-mb 64] [--vllm]
    python tools/bench_weight_sync.py --transfer delta [--engine-dtype float16] [--lr 1e-6] [--reps 4]
    python tools/bench_weight_sync.py --lora 16 [--engine-dtype bfloat16] [--reps 4]

Three measurements, one run:
- raw: one gloo broadcast of size-mb bytes from this process to a receiver process, into a
  buffer it has already written (one broadcast travels on one TCP connection of the group);
  repetitions of raw and ours alternate, so a busy machine slows both alike;
- ours: `GlooWeightSender.push` of a Qwen2-shaped float32 parameter list of about size-mb,
  to a receiver process that is NOT vLLM: `GlooWeightReceiver` (sync/gloo_receiver.py) joins the
  same group, checks the header and loads the push into preallocated parameters in place (a
  large tensor straight into its parameter, small ones through a reusable buffer); its
  broadcasts alternate between the group's connections (`--connections`, default 2);
- vllm (with --vllm): the same push into a real vLLM-CPU engine (`receive_weights`, which
  includes vLLM's layerwise reload, the CPU GEMM repacking and the prefix-cache reset).

- with --transfer delta, instead: a whole push against a delta push (sync.transfer=delta) of the
  same RL-like update of Qwen2.5-0.5B's shape, alternating which goes first each round; bytes on
  the wire, time, and at the end whether both receivers hold the same bits.
- with --lora RANK, instead: a whole push of Qwen2.5-0.5B's shape against a push of a rank-RANK
  adapter on every linear layer of its decoder (learner.lora, in peft's tensor names), both in the
  engines' dtype as the learner sends them, alternating which goes first each round.

Times run from the sender's start to the receiver's last byte applied; both processes read
the same monotonic clock. Each is repeated; the first repetition touches fresh memory (page
faults are expensive on these machines) and is reported separately from the warm median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import string
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.sync.buckets import is_direct, plan_buckets, specs_of
from asyncrl.sync.gloo_receiver import GlooWeightReceiver
from asyncrl.sync import wire
from asyncrl.sync.gloo_sender import GlooWeightSender
from asyncrl.sync.wire import broadcast, free_port, open_gloo_group

HOST = "127.0.0.1"


def qwen2_layer(hidden: int, inter: int, kv: int) -> list[tuple[str, list[int]]]:
    """One Qwen2 decoder layer's parameter shapes (q has `hidden` outputs, k and v `kv`)."""
    return [("self_attn.q_proj.weight", [hidden, hidden]), ("self_attn.q_proj.bias", [hidden]),
            ("self_attn.k_proj.weight", [kv, hidden]), ("self_attn.k_proj.bias", [kv]),
            ("self_attn.v_proj.weight", [kv, hidden]), ("self_attn.v_proj.bias", [kv]),
            ("self_attn.o_proj.weight", [hidden, hidden]),
            ("mlp.gate_proj.weight", [inter, hidden]),
            ("mlp.up_proj.weight", [inter, hidden]), ("mlp.down_proj.weight", [hidden, inter]),
            ("input_layernorm.weight", [hidden]), ("post_attention_layernorm.weight", [hidden])]


def qwen2_model(vocab: int, hidden: int, num_layers: int, layer) -> list[tuple[str, list[int]]]:
    """A tied-embedding Qwen2's parameter shapes, in Hugging Face order."""
    shapes = [("model.embed_tokens.weight", [vocab, hidden])]
    shapes += [(f"model.layers.{i}.{n}", s) for i in range(num_layers) for n, s in layer]
    return shapes + [("model.norm.weight", [hidden])]


# Qwen2.5-0.5B (tools/bench_learner.py's qwen2.5-0.5b): hidden 896, MLP 4864, 24 layers, 2 KV heads of 64
QWEN25_05B = qwen2_model(151936, 896, 24, qwen2_layer(896, 4864, 2 * 64))


def qwen2_shapes(size_mb: float) -> tuple[dict, list[tuple[str, list[int]]]]:
    """A tied-embedding Qwen2 config and its HF parameter shapes, about `size_mb` in float32."""
    hidden = 1024 if size_mb >= 100 else 512 if size_mb >= 25 else 256
    inter, heads, kv_heads, vocab = hidden * 11 // 4, hidden // 64, max(1, hidden // 256), 8192
    layer = qwen2_layer(hidden, inter, kv_heads * 64)
    per_layer = sum(torch.Size(s).numel() for _, s in layer) * 4 / 1e6
    num_layers = max(1, round((size_mb - vocab * hidden * 4 / 1e6) / per_layer))
    shapes = qwen2_model(vocab, hidden, num_layers, layer)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": num_layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 64,
              "max_position_embeddings": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32",
              "bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0}
    return config, shapes


def make_params(shapes, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s, generator=g) * 0.02) for n, s in shapes]


def plain_receiver(ports: tuple[int, int], total_bytes: int, plan: list[dict], reps: int,
                   done, shapes, connections: int) -> None:
    """Rank 1 of both groups: per repetition one raw broadcast, then one push applied into
    preallocated parameters. Reports the time its last byte landed on `done`, and at the end
    whether the parameters hold exactly what was sent."""
    wire.GLOO_CONNECTIONS = connections
    raw_group, _raw_store = open_gloo_group(HOST, ports[0], 1, 2, timeout_s=120)
    receiver = GlooWeightReceiver(HOST, ports[1], 1, 2, timeout_s=120)
    receiver.connect()
    raw = torch.zeros(total_bytes, dtype=torch.uint8)  # written once: no page faults timed
    params = {e["name"]: torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"]))
              for b in plan for e in b["tensors"]}
    for version in range(1, reps + 1):
        broadcast(raw_group, raw).wait()
        done.put(time.perf_counter())
        receiver.receive(plan, version, params)
        done.put(time.perf_counter())
    done.put(all(torch.equal(params[n], t) for n, t in make_params(shapes, seed=0)))


def bench_plain(named, shapes, bucket_bytes: int, reps: int,
                connections: int) -> tuple[list[float], list[float]]:
    """Seconds per raw broadcast and per push (interleaved), against a plain receiver process."""
    plan = plan_buckets(specs_of(named), bucket_bytes)
    total = sum(t.numel() * t.element_size() for _, t in named)
    ports, ctx = (free_port(), free_port()), mp.get_context("spawn")
    done = ctx.Queue()
    proc = ctx.Process(target=plain_receiver, args=(ports, total, plan, reps, done, shapes, connections))
    proc.start()
    default, wire.GLOO_CONNECTIONS = wire.GLOO_CONNECTIONS, connections
    raw_group, _raw_store = open_gloo_group(HOST, ports[0], 0, 2, timeout_s=120)
    sender = GlooWeightSender(HOST, ports[1], 2, timeout_s=120, bucket_bytes=bucket_bytes)
    sender.connect()
    sender.metadata(named)  # the receiver got the same plan as its process argument
    payload = torch.ones(total, dtype=torch.uint8)
    raw_s, ours_s = [], []
    for version in range(1, reps + 1):
        start = time.perf_counter()
        broadcast(raw_group, payload).wait()
        raw_s.append(done.get(timeout=120) - start)
        start = time.perf_counter()
        sender.push(named, version)
        ours_s.append(done.get(timeout=120) - start)
    if done.get(timeout=120) is not True:
        raise RuntimeError("the receiver's parameters differ from what was pushed")
    proc.join(timeout=60)
    sender.close()
    wire.GLOO_CONNECTIONS = default
    return raw_s, ours_s


def write_checkpoint(path: Path, config: dict, named) -> None:
    """config.json, safetensors and a char-level tokenizer: a model vLLM can load."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = ["<pad>", "<eos>", "<unk>"] + list(string.printable[:95])
    chars += [f"<x{i}>" for i in range(len(chars), config["vocab_size"])]  # pad to the model's
    vocab = {c: i for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
         "unk_token": "<unk>"}))
    (path / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in named}, str(path / "model.safetensors"))


async def bench_vllm(config: dict, named, bucket_bytes: int, reps: int) -> list[float]:
    """Seconds per push into a real vLLM-CPU engine (push and receive_weights concurrently)."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from asyncrl.compat import hide_broken_torch_extras

    hide_broken_torch_extras()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from asyncrl.rollout.vllm_engine import one_engine_process_on_cpu
    from asyncrl.sync.vllm_receiver import engine_kwargs, init_receiver, receive_weights

    one_engine_process_on_cpu()  # the actor's engine layout

    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), config, named)
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=tmp, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4,
            disable_log_stats=True, **engine_kwargs("gloo")))
    port = free_port()
    sender = GlooWeightSender(HOST, port, 2, timeout_s=120, bucket_bytes=bucket_bytes)
    try:
        await asyncio.gather(asyncio.to_thread(sender.connect),
                             init_receiver(llm, HOST, port, rank=1, world_size=2, timeout_s=120))
        metadata = sender.metadata(named)
        seconds, phases = [], []
        for version in range(1, reps + 1):
            start = time.perf_counter()
            _, stats = await asyncio.gather(asyncio.to_thread(sender.push, named, version),
                                            receive_weights(llm, metadata, version))
            seconds.append(time.perf_counter() - start)
            phases.append(f"{stats['sync/receive_s']:.3f}+{stats['sync/finish_s']:.3f}s")
        print("vllm   receive+finish per run:", ", ".join(phases))
        return seconds
    finally:
        sender.close()
        llm.shutdown()
        del llm  # now, not at interpreter exit, where vLLM's __del__ shutdown finds its modules gone


def transfer_receiver(ports: tuple[int, int], plans: list[list[dict]], rounds: int, done) -> None:
    """Rank 1 of two groups (full and delta transfer, or a whole model and an adapter), each into
    its own copy of what its plan holds, in the engines' dtype. Per round it receives both pushes,
    in the order the sender makes them (`first_of`), reporting when each one's last byte landed; at
    the end whether both copies are equal bit for bit (the delta path against the full one)."""
    receivers = [GlooWeightReceiver(HOST, port, 1, 2, timeout_s=300) for port in ports]
    for receiver in receivers:
        receiver.connect()
    held = [{e["name"]: torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])) for b in plan for e in b["tensors"]}
            for plan in plans]
    for version in range(rounds + 1):
        for which in first_of(version):
            stats = receivers[which].receive(plans[which], version, held[which])
            done.put((time.perf_counter(), stats["sync/verify_failures"]))
    done.put(held[0].keys() == held[1].keys() and
             all(torch.equal(held[0][n].view(torch.uint8), held[1][n].view(torch.uint8)) for n in held[0]))


def first_of(version: int) -> tuple[int, int]:
    """The order of the two pushes in a round (0 full, 1 delta): alternating, so neither side always
    runs on a machine the other has just warmed or loaded."""
    return (0, 1) if version % 2 else (1, 0)


def two_groups(sides, transfers, rounds: int, bucket_bytes: int):
    """A `transfer_receiver` process and one sender per side (its own group, its plan from the
    side's tensors and its transfer); the process, the senders and the queue it reports on."""
    plans = [plan_buckets(specs_of(named), bucket_bytes) for named in sides]
    ports, ctx = (free_port(), free_port()), mp.get_context("spawn")
    done = ctx.Queue()
    proc = ctx.Process(target=transfer_receiver, args=(ports, plans, rounds, done))
    proc.start()
    senders = [GlooWeightSender(HOST, port, 2, timeout_s=300, bucket_bytes=bucket_bytes, transfer=transfer)
               for port, transfer in zip(ports, transfers)]
    for sender, named in zip(senders, sides):
        sender.connect()
        sender.metadata(named)
    return proc, senders, done


def alternating_rounds(senders, pushed, rounds: int, done, before=None) -> list[dict]:
    """Versions 0..rounds: `before(version)`, then both senders push `pushed(which)` in `first_of`'s
    order; per push, seconds from its start to the receiver's last byte, and bytes on the wire."""
    rows = []
    for version in range(rounds + 1):
        if before is not None:
            before(version)
        for which in first_of(version):
            start = time.perf_counter()
            stats = senders[which].push(pushed(which), version)
            landed, failures = done.get(timeout=300)
            rows.append({"version": version, "which": which, "seconds": landed - start,
                         "bytes": stats["sync/push_bytes"], "num_bytes": stats["sync/num_bytes"],
                         "changed_frac": stats.get("sync/changed_frac"), "verify_failures": failures})
    return rows


def bench_transfer(engine_dtype: torch.dtype, rounds: int, lr: float, bucket_bytes: int) -> list[dict]:
    """Full against delta pushes of Qwen2.5-0.5B's shape after RL-like updates: fp32 masters (std
    0.02, norms 1) take an AdamW step at `lr` on a fresh noise gradient each round, and both pushes
    send the result cast to `engine_dtype`, the cast included as in the learner. Returns per round
    and side: seconds (sender start to the receiver's last byte) and bytes on the wire."""
    g = torch.Generator().manual_seed(0)
    master = [(n, (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02).requires_grad_())
              for n, s in QWEN25_05B]
    optimizer = torch.optim.AdamW([p for _, p in master], lr=lr, weight_decay=0.0, foreach=True)

    def engine_weights():
        return ((n, p.detach().to(engine_dtype)) for n, p in master)

    proc, senders, done = two_groups([list(engine_weights())] * 2, ("full", "delta"), rounds, bucket_bytes)
    def step(version):  # version 0: both whole, the delta side's shadow filled
        if version:
            for _, p in master:
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()

    rows = [{**row, "transfer": senders[row["which"]].transfer}
            for row in alternating_rounds(senders, lambda _: engine_weights(), rounds, done, step)]
    if done.get(timeout=300) is not True:
        raise RuntimeError("the delta receiver's weights differ from the full receiver's")
    proc.join(timeout=60)
    for sender in senders:
        sender.close()
    return rows


def report_transfer(rows: list[dict], engine_dtype: torch.dtype, lr: float) -> None:
    by = {(r["version"], r["transfer"]): r for r in rows}
    versions = sorted({r["version"] for r in rows if r["version"]})
    print(f"Qwen2.5-0.5B shape, engines in {str(engine_dtype).removeprefix('torch.')}, AdamW lr {lr:g} "
          f"({by[(0, 'full')]['num_bytes'] / 1e6:.0f} MB a whole push)")
    print("round | changed | delta MB | full s | delta s | delta/full bytes | delta/full time")
    for v in versions:
        full, delta = by[(v, "full")], by[(v, "delta")]
        print(f"{v:5d} | {delta['changed_frac']:7.2%} | {delta['bytes'] / 1e6:8.1f} | {full['seconds']:6.3f} | "
              f"{delta['seconds']:7.3f} | {delta['bytes'] / full['bytes']:16.3f} | "
              f"{delta['seconds'] / full['seconds']:15.2f}")
    ratio_bytes = statistics.median(by[(v, "delta")]["bytes"] / by[(v, "full")]["bytes"] for v in versions)
    ratio_time = statistics.median(by[(v, "delta")]["seconds"] / by[(v, "full")]["seconds"] for v in versions)
    failures = sum(r["verify_failures"] for r in rows)
    print(f"median delta/full: bytes {ratio_bytes:.3f}, time {ratio_time:.2f}; checksum failures {failures}; "
          "the two receivers' weights equal bit for bit")


def lora_shapes(shapes, rank: int) -> list[tuple[str, list[int]]]:
    """A rank-`rank` adapter on every linear layer of a decoder (`all-linear`): A [rank, in] and
    B [out, rank] per `*_proj.weight` [out, in], under the names peft saves them by."""
    out = []
    for name, (rows, cols) in ((n, s) for n, s in shapes if n.endswith("_proj.weight")):
        layer = "base_model.model." + name.removesuffix(".weight")
        out += [(f"{layer}.lora_A.weight", [rank, cols]), (f"{layer}.lora_B.weight", [rows, rank])]
    return out


def bench_lora(engine_dtype: torch.dtype, rounds: int, rank: int, bucket_bytes: int) -> list[dict]:
    """A whole push of Qwen2.5-0.5B's shape against an adapter push, both in `engine_dtype` and
    random, alternating which goes first; per round and side, seconds and bytes on the wire."""
    sides = [make_params(QWEN25_05B, seed=0), make_params(lora_shapes(QWEN25_05B, rank), seed=1)]
    sides = [[(n, t.to(engine_dtype)) for n, t in named] for named in sides]
    proc, senders, done = two_groups(sides, ("full", "full"), rounds, bucket_bytes)
    # version 0: first touches of both receivers' memory, not reported
    rows = [{**row, "side": ("full", "adapter")[row["which"]]}
            for row in alternating_rounds(senders, lambda which: sides[which], rounds, done)]
    done.get(timeout=300)  # the copies differ in kind: nothing to compare
    proc.join(timeout=60)
    for sender in senders:
        sender.close()
    return rows


def report_lora(rows: list[dict], engine_dtype: torch.dtype, rank: int) -> None:
    by = {(r["version"], r["side"]): r for r in rows}
    versions = sorted({r["version"] for r in rows if r["version"]})
    full0, adapter0 = by[(0, "full")], by[(0, "adapter")]
    print(f"Qwen2.5-0.5B shape in {str(engine_dtype).removeprefix('torch.')}: whole push {full0['bytes'] / 1e6:.0f} MB, "
          f"rank-{rank} adapter on every linear layer {adapter0['bytes'] / 1e6:.1f} MB")
    print("round | full s | adapter s | adapter/full bytes | adapter/full time")
    for v in versions:
        full, adapter = by[(v, "full")], by[(v, "adapter")]
        print(f"{v:5d} | {full['seconds']:6.3f} | {adapter['seconds']:9.4f} | {adapter['bytes'] / full['bytes']:18.4f} | "
              f"{adapter['seconds'] / full['seconds']:17.4f}")
    ratio_time = statistics.median(by[(v, "adapter")]["seconds"] / by[(v, "full")]["seconds"] for v in versions)
    print(f"median adapter/full: bytes {adapter0['bytes'] / full0['bytes']:.4f}, time {ratio_time:.4f}; "
          f"checksum failures {sum(r['verify_failures'] for r in rows)}")


def summary(label: str, num_bytes: int, seconds: list[float]) -> float:
    warm = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    print(f"{label:<6} {num_bytes / warm / 1e9:6.2f} GB/s warm median   "
          f"(first {num_bytes / seconds[0] / 1e9:5.2f} GB/s; runs: "
          f"{', '.join(f'{s:.3f}s' for s in seconds)})")
    return num_bytes / warm / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=200.0, help="model size to push (MB)")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket bound (MB)")
    parser.add_argument("--reps", type=int, default=4, help="repetitions per measurement")
    parser.add_argument("--vllm", action="store_true", help="also push into a real vLLM-CPU engine")
    parser.add_argument("--connections", type=int, default=wire.GLOO_CONNECTIONS,
                        help="TCP connections of the raw and plain groups (the vLLM one keeps the default)")
    parser.add_argument("--transfer", choices=["full", "delta"], default="full",
                        help="delta: full against delta pushes of the 0.5B shape after AdamW steps, in "
                             "alternating rounds (--reps rounds), instead of the raw comparison")
    parser.add_argument("--engine-dtype", choices=["float16", "bfloat16"], default="float16",
                        help="--transfer delta: the engines' dtype (float16: vLLM-CPU's bf16 kernels crash here)")
    parser.add_argument("--lr", type=float, default=1e-6, help="--transfer delta: AdamW's learning rate")
    parser.add_argument("--lora", type=int, metavar="RANK", default=0,
                        help="a whole push of the 0.5B shape against a rank-RANK adapter's (learner.lora), in "
                             "alternating rounds (--reps rounds, --engine-dtype), instead of the raw comparison")
    args = parser.parse_args()
    if args.lora:
        dtype = getattr(torch, args.engine_dtype)
        report_lora(bench_lora(dtype, args.reps, args.lora, int(args.bucket_mb * 1e6)), dtype, args.lora)
        return
    if args.transfer == "delta":
        dtype = getattr(torch, args.engine_dtype)
        report_transfer(bench_transfer(dtype, args.reps, args.lr, int(args.bucket_mb * 1e6)), dtype, args.lr)
        return
    config, shapes = qwen2_shapes(args.size_mb)
    named = make_params(shapes, seed=0)
    num_bytes = sum(t.numel() * t.element_size() for _, t in named)
    bucket_bytes = int(args.bucket_mb * 1e6)
    plan = plan_buckets(specs_of(named), bucket_bytes)
    print(f"{num_bytes / 1e6:.0f} MB in {len(named)} tensors ({config['num_hidden_layers']} "
          f"layers, hidden {config['hidden_size']}), {len(plan)} buckets of <= "
          f"{args.bucket_mb:g} MB ({sum(map(is_direct, plan))} of them one tensor sent in place); "
          f"{args.connections} connection(s)")
    raw_s, ours_s = bench_plain(named, shapes, bucket_bytes, args.reps, args.connections)
    raw = summary("raw", num_bytes, raw_s)
    ours = summary("ours", num_bytes, ours_s)
    print(f"ratio ours/raw: {ours / raw:.2f}")
    if args.vllm:
        new_params = make_params(shapes, seed=1)
        vllm_s = asyncio.run(bench_vllm(config, new_params, bucket_bytes, args.reps))
        into_vllm = summary("vllm", num_bytes, vllm_s)
        print(f"ratio vllm/raw: {into_vllm / raw:.2f}")


if __name__ == "__main__":
    main()
