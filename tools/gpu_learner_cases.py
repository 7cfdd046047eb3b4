"""tools/gpu_check.py's learner parts: (b) the fixed-length learner steps and (f) the sweep with
RL-like lengths, each a `Case` run through a real `LearnerRank` (torch backend, one rank), bf16
compute over float32 masters (a LoRA case: float32 adapters over a frozen bf16 base); what each
reports, and the model FLOPs its MFU counts (gpu_check.py's docstring). Imports asyncrl and torch
only inside the functions: gpu_check.py puts the carried wheels on the path first."""

from __future__ import annotations

import platform
import random
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from gpu_setup import guarded

# dense bf16 peak, FLOP/s, by a substring of torch.cuda.get_device_name() (first match wins)
PEAKS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
         ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12)]
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=256)


@cache
def bench_learner():
    """tools/bench_learner.py (imported when first needed: it imports asyncrl): its SHAPES, hf_model
    and RL lengths, so that this check and the learner benchmark build and feed the same models."""
    import bench_learner as module

    return module


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
