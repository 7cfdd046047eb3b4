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

Parts (b) and (f) live in tools/gpu_learner_cases.py; the wheels, the pytest parts and the record-and-go-on
wrapper in tools/gpu_setup.py.

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
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# tools/ is not a package: its siblings import by name, whether this runs as a script or is loaded by path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_learner_cases import run_learner, run_sweep, sweep_cases  # noqa: E402  (imports asyncrl lazily)
from gpu_setup import guarded, run_pytest, use_carried_wheels  # noqa: E402


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
