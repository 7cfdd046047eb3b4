"""One run of the learner side on a lent GPU machine; from the repository root, with .whl/ carried:

    python3 tools/gpu_check.py

(The machine has torch, transformers, safetensors, msgpack and pytest but no pydantic, PyYAML or
pyzmq, and no network: the script unpacks the wheels in .whl/ that fit this Python into a
temporary directory and puts it first on its path and its children's. The same with pip:
`pip install --no-index --find-links .whl pydantic pyyaml pyzmq deepspeed && python3 tools/gpu_check.py`.
Fill .whl/ on a machine with a registry, for CPython 3.10-3.12, as `tools/fetch_gpu_wheels.sh` does.)

Parts, each under its own time limit; a part that fails is recorded and the next one runs:
(a) pytest on the gpu-marked tests (tests/integration/test_learner_cuda.py), the mixed-precision
    tests and the NCCL packing tests (their CUDA cases run here, their CPU cases too), but
    DeepSpeed's, which run last as `pytest_deepspeed` (reported, not part of "ok": DeepSpeed
    is carried as a wheel built from its sdist and may try to JIT-build an op);
(b) optimizer steps of a Qwen2.5-0.5B-shaped model (random init, built here from a Qwen2Config:
    hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936, tied
    embeddings) through a real `LearnerRank` (torch backend, policy step, batches over zmq),
    bf16 compute over float32 master weights: loss tokens/s, peak memory, and model FLOPs
    utilisation against the card's dense bf16 peak (the table below, by device name); then one
    step more timed by phase (`phase_s`: body forward, LM head, backward, optimizer;
    asyncrl/learner/phases.py), which every case of (f) reports too;
(c) the NCCL sender's packing throughput on the same model's weights (CUDA, cast to bf16 as a
    push to bf16 engines is): the learner's own push path into a group that drops the bytes,
    so it measures packing alone (one GPU cannot hold two NCCL ranks);
(d) `calibrate`: a bf16 matmul's achieved FLOP/s, the peak this card reaches in practice (MFU is
    reported against it and against the datasheet's);
(e) `parity_floor`: on part (b)'s model, one sequence's logprobs under bf16 autocast against
    float32, with the float32 head and with the bf16 one: the gap a bf16 learner shows before any
    engine is involved (what `sync.probe_tolerance` for bf16 must allow);
(f) `sweep`: learner steps with RL-like lengths (prompts 64-256, responses lognormal, mean 400,
    capped at 1,024; tools/bench_learner.py's) in the GPU recipes' settings (packed micro-batches,
    one-pass float32 head, checkpointed layers), on the 0.5B shape against the learner as it was
    (padded, head recomputed, no checkpointing), then 1.5B and 4B shapes (Qwen2.5-1.5B's and
    Qwen3-4B's config.json values) at 16K and 32K tokens a micro-batch: tokens/s, MFU, peak
    memory, padding; last, the 4B shape at 32K with the LoRA recipe's rank-16 adapters (its frozen
    base in bf16). Cases run while `--time-budget` allows; the rest are listed as skipped.

Prints one JSON line and writes it to $OUT/gpu_check.json when OUT is set (pytest's output goes
beside it: gpu_check_pytest.txt, gpu_check_pytest_deepspeed.txt). `--cpu-smoke` runs the same
parts on CPU with a tiny model and pytest only collecting, to prove the script end to end
(tests/integration/test_gpu_check.py does).

Model FLOPs per step (what MFU counts; recomputation is not counted): 6 * N_body * all tokens
(N_body: the parameters besides the embedding matrix, whose lookup is no matmul), plus 6 * V * H
* loss tokens (the LM head runs only on the loss positions), plus causal attention
6 * layers * H * sum of squared sequence lengths.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# dense bf16 peak, FLOP/s, by a substring of torch.cuda.get_device_name() (first match wins)
PEAKS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
         ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12)]
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=256)


def sibling(name: str):
    """tools/<name>.py, loaded by path (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# carrying the wheels this machine lacks, and the pytest parts: tools/gpu_setup.py
setup = sibling("gpu_setup")
use_carried_wheels, run_pytest, wheel_fits = setup.use_carried_wheels, setup.run_pytest, setup.wheel_fits


@cache
def bench_learner():
    """tools/bench_learner.py, loaded by path (tools/ is not a package): its SHAPES, hf_model and RL
    lengths, so that this check and the learner benchmark build and feed the same models."""
    return sibling("bench_learner")


# -- (b) learner steps ------------------------------------------------------------------------

def build_model(path: Path, shape: dict | str, device) -> tuple[int, object]:
    """A randomly initialised model with the tiny tokenizer, saved to `path`: a Qwen2 of `shape`'s
    config values, or one of tools/bench_learner.py's SHAPES by name."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.tiny.tokenizer import save_tokenizer

    vocab = len(save_tokenizer(path))  # the learner reads a pad id from it; token ids come from the model's vocabulary
    with torch.device(device):  # initialised where it will train: a CPU init of 0.5B takes a while
        if isinstance(shape, str):
            model = bench_learner().hf_model(shape, vocab)
        else:
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(Qwen2Config(**shape))
    model.save_pretrained(path)
    n, cfg = sum(p.numel() for p in model.parameters()), model.config
    del model
    return n, cfg


def step_chunks(step: int, num_seqs: int, prompt_len: int, response_len: int, vocab: int, lengths: str = "fixed",
                budget: int = 0):
    """`num_seqs` sequences of fixed lengths; with lengths="rl", RL-like ones until `budget` loss tokens."""
    from asyncrl.types import SequenceChunk

    rng = random.Random(step)
    old = -float(__import__("math").log(vocab))  # a random-init policy is near uniform: ratios near 1

    def chunk(i, p, r):
        return SequenceChunk(f"g{i}", 0, [rng.randrange(vocab) for _ in range(p)],
                             [rng.randrange(vocab) for _ in range(r)], 0, [old] * r, [step - 1] * r,
                             advantage=rng.choice((-1.0, 1.0)))

    if lengths == "fixed":
        return [chunk(i, prompt_len, response_len) for i in range(num_seqs)]
    out, total = [], 0
    while total < budget:
        p, r = bench_learner().lengths(rng, "rl")
        out.append(chunk(len(out), p, min(r, budget - total)))
        total += out[-1].num_loss_tokens
    return out


def model_flops(cfg, num_params: int, seq_lens: list[int], loss_tokens: int) -> float:
    head = cfg.vocab_size * cfg.hidden_size
    body = num_params - head * (1 if cfg.tie_word_embeddings else 2)
    attention = 6 * cfg.num_hidden_layers * cfg.hidden_size * sum(s * s for s in seq_lens)
    return 6 * body * sum(seq_lens) + 6 * head * loss_tokens + attention


def peak_flops(device_name: str) -> tuple[float | None, str]:
    for key, peak in PEAKS:
        if key in device_name:
            return peak, f"{key} dense bf16 {peak / 1e12:.0f} TFLOP/s"
    return None, f"no peak known for {device_name!r}: MFU not reported"


@dataclass
class Case:
    """One learner measurement: a model shape, the steps' lengths and the learner's settings."""

    name: str
    shape: dict | str
    micro_batch_tokens: int
    settings: dict = field(default_factory=dict)  # LearnerConfig fields
    lengths: str = "fixed"  # or "rl": RL-like, until `budget` loss tokens a step
    budget: int = 0
    seqs: int = 32
    prompt_len: int = 256
    response_len: int = 768
    warmup: int = 3
    steps: int = 8


def run_case(case: Case, tmp: Path, cuda: bool, calibrated: float | None = None,
             keep: bool = False) -> tuple[dict, object]:
    """`case`'s timed steps through a real LearnerRank (torch backend, one rank), bf16 compute over
    float32 masters; its figures, and the learner when `keep` (else it is shut down)."""
    import torch

    from asyncrl.config import AlgoConfig, LearnerConfig
    from asyncrl.learner.phases import timing_phases
    from asyncrl.learner.rank import LearnerRank
    from asyncrl.transport.codec import encode_batch
    from asyncrl.transport.zmq_stream import FrameSender
    from asyncrl.types import Batch

    device = "cuda" if cuda else "cpu"
    t0 = time.monotonic()
    model_dir = tmp / f"model-{case.shape if isinstance(case.shape, str) else 'qwen2'}"
    num_params, cfg = build_model(model_dir, case.shape, device)
    build_s = time.monotonic() - t0
    lc = LearnerConfig(lr=1e-6, micro_batch_tokens=case.micro_batch_tokens, param_dtype="float32",
                       num_gpus=1 if cuda else 0, **case.settings)
    learner = LearnerRank(str(model_dir), lc, AlgoConfig(aggregation="token_mean"), dtype="bfloat16")
    sender = FrameSender(learner.batch_endpoint())
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, rows, flops = [], [], []
    chunks, loss_tokens = [], 0
    for step in range(1, case.warmup + case.steps + 1):
        chunks = step_chunks(step, case.seqs, case.prompt_len, case.response_len, cfg.vocab_size, case.lengths,
                             case.budget)
        loss_tokens = sum(c.num_loss_tokens for c in chunks)
        sender.send(encode_batch(Batch(step=step, rank=0, chunks=chunks, num_loss_tokens_global=loss_tokens,
                                       num_sequences_global=len(chunks), token_budget=loss_tokens)))
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = learner.train_step(step).metrics  # returns host floats: the step has finished
        if step > case.warmup:
            times.append(time.perf_counter() - start)
            rows.append(metrics)
            flops.append(model_flops(cfg, num_params, [c.num_tokens for c in chunks], loss_tokens))
    # one step more with its phases timed (each phase synchronizes the device: not in the figures above)
    step = case.warmup + case.steps + 1
    chunks_p = step_chunks(step, case.seqs, case.prompt_len, case.response_len, cfg.vocab_size, case.lengths,
                           case.budget)
    phase_tokens = sum(c.num_loss_tokens for c in chunks_p)
    sender.send(encode_batch(Batch(step=step, rank=0, chunks=chunks_p, num_loss_tokens_global=phase_tokens,
                                   num_sequences_global=len(chunks_p), token_budget=phase_tokens)))
    start = time.perf_counter()
    with timing_phases() as phase_s:
        learner.train_step(step)
    phases_total = time.perf_counter() - start
    sender.close()
    step_s = sorted(times)[len(times) // 2]
    seconds, total_flops = sum(times), sum(flops)
    tokens = sum(r["learner/tokens_rank0"] for r in rows)
    name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    peak, peak_note = peak_flops(name) if cuda else (None, "CPU: MFU not reported")
    trained = [p for p in learner.model.parameters() if p.requires_grad]
    masters = {str(p.dtype) for p in trained}
    frozen = {str(p.dtype) for p in learner.model.parameters() if not p.requires_grad}
    out = {
        "ok": True, "case": case.name, "shape": case.shape if isinstance(case.shape, str) else "qwen2.5-0.5b",
        "device": name, "params": num_params, "build_s": round(build_s, 1), "settings": case.settings,
        "compute_dtype": "bfloat16", "param_dtypes": sorted(masters), "frozen_dtypes": sorted(frozen),
        "trainable_params": sum(p.numel() for p in trained), "lengths": case.lengths,
        "steps_timed": len(times), "warmup_steps": case.warmup, "seqs_per_step": len(chunks),
        "tokens_per_step": sum(c.num_tokens for c in chunks), "loss_tokens_per_step": loss_tokens,
        "micro_batch_tokens": case.micro_batch_tokens, "step_s_median": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in times],
        "loss_tokens_per_s": round(sum(r["learner/loss_tokens"] for r in rows) / seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1),
        "padding_frac": round(sum(r["learner/padding_frac"] for r in rows) / len(rows), 4),
        "packed": rows[-1]["learner/packed"] == 1.0,
        "model_tflops_per_step": round(total_flops / len(flops) / 1e12, 3),
        "achieved_tflops": round(total_flops / seconds / 1e12, 2),
        "peak_used": peak_note, "mfu": round(total_flops / seconds / peak, 4) if peak else None,
        "mfu_calibrated": round(total_flops / seconds / calibrated, 4) if calibrated else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "peak_mem_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        "loss_first_last": [rows[0]["loss/total"], rows[-1]["loss/total"]],
        "grad_norm_last": rows[-1]["learner/grad_norm"],
        "phase_s": {k: round(v, 4) for k, v in phase_s.items()}, "phase_step_s": round(phases_total, 4),
    }
    if masters != {"torch.float32"}:
        out.update(ok=False, error=f"master weights are {masters}, not float32")
    elif "lora" in case.settings and frozen != {"torch.bfloat16"}:  # the frozen base in the engines' dtype
        out.update(ok=False, error=f"a LoRA policy's frozen base is {frozen}, not bfloat16")
    if "lora" in case.settings:
        out["flops_counted"] = ("6 x parameters per token, as a full-parameter step counts, so the two compare; "
                                "a LoRA step computes no gradient for the frozen weights, about a third less")
    if not keep:
        learner.shutdown()
        del learner
        learner = None
        if cuda:
            torch.cuda.empty_cache()
    return out, learner


def run_learner(args, tmp: Path, cuda: bool, calibrated: float | None) -> tuple[dict, object]:
    """Part (b): the fixed-length steps of earlier runs (comparable across them), learner kept."""
    case = Case("fixed_0.5b", TINY if args.cpu_smoke else QWEN_05B, args.micro_batch_tokens, seqs=args.seqs,
                prompt_len=args.prompt_len, response_len=args.response_len, warmup=args.warmup, steps=args.steps)
    return run_case(case, tmp, cuda, calibrated, keep=True)


# the GPU recipes' learner (configs/gpu_single_node.yaml), and the learner as it was before it
RECIPE = dict(pack_sequences=True, recompute_head=False, activation_checkpointing=True, head_dtype="float32")
BEFORE = dict(pack_sequences=False, recompute_head=True, activation_checkpointing=False, head_dtype="compute")
# configs/gpu_single_node_lora.yaml's learner: the recipe's, with rank-16 adapters on the decoder's linear layers
LORA = dict(RECIPE, lora=dict(rank=16, alpha=32.0))


def sweep_cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("rl_tiny_before", "tiny", 256, BEFORE, "rl", budget=256, warmup=1, steps=1),
                Case("rl_tiny_recipe", "tiny", 256, RECIPE, "rl", budget=256, warmup=1, steps=1),
                Case("rl_tiny_lora", "tiny", 256, LORA, "rl", budget=256, warmup=1, steps=1)]
    return [Case("rl_0.5b_before", "qwen2.5-0.5b", 16384, BEFORE, "rl", budget=32768, warmup=2, steps=3),
            Case("rl_0.5b_recipe", "qwen2.5-0.5b", 16384, RECIPE, "rl", budget=32768, warmup=2, steps=3),
            Case("rl_1.5b_recipe", "qwen2.5-1.5b", 16384, RECIPE, "rl", budget=32768, warmup=2, steps=3),
            Case("rl_4b_recipe_16k", "qwen3-4b", 16384, RECIPE, "rl", budget=32768, warmup=1, steps=3),
            Case("rl_4b_recipe_32k", "qwen3-4b", 32768, RECIPE, "rl", budget=32768, warmup=1, steps=3),
            # last: it runs only where the time budget allows (prime-rl reports 36.8% MFU for this shape and rank)
            Case("rl_4b_lora16_32k", "qwen3-4b", 32768, LORA, "rl", budget=32768, warmup=1, steps=3)]


def run_sweep(cases: list[Case], tmp: Path, cuda: bool, calibrated: float | None, deadline: float) -> dict:
    """Each case in turn while at least a case's worth of time is left (the longest one so far);
    a case that fails is recorded and the next one runs."""
    results, longest = [], 0.0
    for case in cases:
        left = deadline - time.monotonic()
        if left < max(longest, 1.0):
            results.append({"ok": True, "case": case.name, "skipped": f"{left:.0f}s left of --time-budget"})
            continue
        t0 = time.monotonic()
        one: dict = {}
        guarded(one, "result", run_case, case, tmp, cuda, calibrated)
        results.append(one["result"] | ({"case": case.name} if not one["result"].get("ok") else {}))
        longest = max(longest, time.monotonic() - t0)
        for stale in tmp.glob("model-*"):  # the next shape's weights need the disk
            __import__("shutil").rmtree(stale, ignore_errors=True)
    by_name = {r["case"]: r for r in results}
    before, recipe = by_name.get("rl_0.5b_before", {}), by_name.get("rl_0.5b_recipe", {})
    ratio = (recipe["loss_tokens_per_s"] / before["loss_tokens_per_s"]
             if "loss_tokens_per_s" in before and "loss_tokens_per_s" in recipe else None)
    return {"ok": all(r["ok"] for r in results), "cases": results, "recipe_vs_before_0.5b": ratio}


# -- (d) calibration, (e) parity floor ----------------------------------------------------------

def run_calibrate(cuda: bool, smoke: bool) -> dict:
    """The achieved FLOP/s of a square bf16 matmul, best of a few timed runs."""
    import torch

    n = 256 if smoke else 8192
    device = "cuda" if cuda else "cpu"
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    best = float("inf")
    for _ in range(3 if smoke else 5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2 if smoke else 20):
            a @ b
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / (2 if smoke else 20))
    return {"ok": True, "n": n, "tflops": round(2 * n ** 3 / best / 1e12, 2), "flops": 2 * n ** 3 / best}


def run_parity_floor(learner, smoke: bool) -> dict:
    """One sequence's logprobs on the learner's weights, under bf16 autocast (float32 head and bf16
    head) against float32 throughout: the gaps a bf16 learner has on its own."""
    import torch

    from asyncrl.learner.collate import collate
    from asyncrl.learner.model_forward import policy_forward
    from asyncrl.types import SequenceChunk

    vocab = int(learner.files.config.vocab_size)
    rng = random.Random(0)
    n = 64 if smoke else 2048
    chunk = SequenceChunk("probe", 0, [rng.randrange(vocab) for _ in range(16)],
                          [rng.randrange(vocab) for _ in range(n)], 0, [0.0] * n, [0] * n, 0.0)
    mb, model = collate([chunk], packed=True), learner.model
    out = {}
    with torch.no_grad():
        exact = policy_forward(model, mb, 1024, learner.device, head_fp32=True).logprobs.double()
        for name, fp32 in (("fp32_head", True), ("bf16_head", False)):
            with torch.autocast(learner.device.type, dtype=torch.bfloat16):
                got = policy_forward(model, mb, 1024, learner.device, head_fp32=fp32).logprobs.double()
            gap = (got - exact).abs()
            out[name] = {"max_abs": float(gap.max()), "mean_abs": float(gap.mean()),
                         "p99_abs": float(gap.quantile(0.99))}
    return {"ok": True, "tokens": n, **out}


# -- (c) packing ------------------------------------------------------------------------------

class DropGroup:
    """A group of one that drops what it is given: the push measures packing alone."""

    def broadcast(self, tensor, src):
        pass

    def destroy(self):
        pass


def run_packing(learner, repeats: int) -> dict:
    from asyncrl.sync.nccl_sender import NcclWeightSender

    device = learner.device
    sender = NcclWeightSender("127.0.0.1", 0, 2, bucket_bytes=256 << 20)
    sender.connect(group=DropGroup(), device=device)
    learner.sender = sender  # the learner's own push path: gather, cast to the engines' dtype, pack
    meta = learner.weight_metadata()
    rows = [learner.push_weights(learner.version) for _ in range(repeats + 1)][1:]  # the first warms the streams up
    sender.close()
    learner.sender = None
    best = max(rows, key=lambda r: r["sync/push_gb_per_s"])
    return {"ok": True, "engine_dtype": str(learner.engine_dtype), "num_tensors": meta["num_tensors"],
            "num_bytes": meta["num_bytes"], "num_chunks": best["sync/num_buckets"], "bucket_mib": 256,
            "gb_per_s_best": round(best["sync/push_gb_per_s"], 2),
            "gb_per_s_all": [round(r["sync/push_gb_per_s"], 2) for r in rows],
            "push_s_best": round(best["sync/push_s"], 4)}


# -- main -------------------------------------------------------------------------------------

def guarded(summary: dict, key: str, fn, *args):
    t0 = time.monotonic()
    try:
        result = fn(*args)
    except BaseException as e:  # record and go on: one device run must report every part it can
        if isinstance(e, KeyboardInterrupt):
            raise
        summary[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                        "traceback": traceback.format_exc()[-3000:]}
        return None
    if isinstance(result, tuple):
        result, extra = result
    else:
        extra = None
    result["seconds"] = round(time.monotonic() - t0, 1)
    summary[key] = result
    return extra


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, pytest only collecting")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["pytest", "learner", "packing", "calibrate", "parity", "sweep"])
    p.add_argument("--seqs", type=int, help="sequences per step (default 32; smoke 4)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens per sequence (default 256; smoke 16)")
    p.add_argument("--response-len", type=int, help="response (loss) tokens per sequence (default 768; smoke 16)")
    p.add_argument("--micro-batch-tokens", type=int, help="tokens per forward/backward (default 8192; smoke 64)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3; smoke 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 8; smoke 2)")
    p.add_argument("--pytest-timeout", type=float, default=120.0, help="seconds for part (a)")
    p.add_argument("--deepspeed-timeout", type=float, default=60.0, help="seconds for DeepSpeed's cases, run last")
    p.add_argument("--time-budget", type=float, default=400.0,
                   help="seconds for the whole check: the sweep stops starting cases past it, keeping "
                        "--deepspeed-timeout for DeepSpeed's cases")
    args = p.parse_args()
    smoke = {"seqs": 4, "prompt_len": 16, "response_len": 16, "micro_batch_tokens": 64, "warmup": 1, "steps": 2}
    full = {"seqs": 32, "prompt_len": 256, "response_len": 768, "micro_batch_tokens": 8192, "warmup": 3, "steps": 8}
    for key, value in (smoke if args.cpu_smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.path.insert(0, str(ROOT))
    t0 = time.monotonic()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"check": "gpu_check", "cpu_smoke": args.cpu_smoke, "python": platform.python_version()}
    try:
        summary["wheels_used"] = use_carried_wheels()
    except SystemExit as e:  # still one JSON line: the run must say why it did nothing
        return finish(summary | {"ok": False, "error": str(e)}, out)
    import torch

    from asyncrl.compat import hide_broken_torch_extras

    hide_broken_torch_extras()  # before transformers: a .[cpu] venv's torchvision breaks its imports
    import transformers

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda:  # LearnerRank trains on CUDA whenever it sees it; the smoke run must not
        torch.cuda.is_available = lambda: False
    summary.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=cuda,
                   transformers=transformers.__version__)
    if "pytest" not in args.skip:
        guarded(summary, "pytest", run_pytest, out, "pytest", args.cpu_smoke, args.pytest_timeout)
    if "calibrate" not in args.skip:
        guarded(summary, "calibrate", run_calibrate, cuda, args.cpu_smoke)
    calibrated = summary.get("calibrate", {}).get("flops")
    learner = None
    with tempfile.TemporaryDirectory() as tmp:
        if "learner" not in args.skip:
            learner = guarded(summary, "learner", run_learner, args, Path(tmp), cuda, calibrated)
        for part, fn, extra in (("packing", run_packing, (1 if args.cpu_smoke else 3,)),
                                ("parity", run_parity_floor, (args.cpu_smoke,))):
            if part in args.skip:
                continue
            if learner is None:
                summary[part] = {"ok": False, "error": "needs the learner part"}
            else:
                guarded(summary, part, fn, learner, *extra)
        if learner is not None:
            learner.shutdown()
            del learner
            if cuda:
                torch.cuda.empty_cache()  # the next parts need the memory back
        if "sweep" not in args.skip:
            deadline = t0 + args.time_budget - (0 if "pytest" in args.skip else args.deepspeed_timeout)
            guarded(summary, "sweep", run_sweep, sweep_cases(args.cpu_smoke), Path(tmp), cuda, calibrated, deadline)
    if "pytest" not in args.skip:
        guarded(summary, "pytest_deepspeed", run_pytest, out, "pytest_deepspeed", args.cpu_smoke,
                args.deepspeed_timeout)
    parts = ("pytest", "learner", "packing", "calibrate", "parity", "sweep")
    summary["ok"] = all(summary[k]["ok"] for k in parts if k in summary)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    return finish(summary, out)


def finish(summary: dict, out: Path) -> int:
    line = json.dumps(summary, default=str)
    print(line, flush=True)
    (out / "gpu_check.json").write_text(line + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
