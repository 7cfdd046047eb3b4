"""The twin's cost models, as pure functions of hardware, model and work: how long an engine
step, a learner step and a weight push take. No state, no clock (engine.py and cluster.py use them).

Engine step (continuous batching, one decode token for every running request):

    step_s = c0 + c_seq * B + c_ctx * C + c_prefill * P

B running requests holding C tokens of context (KV read every step), P prompt tokens prefilled
in the step. `from_hardware` derives the constants from a GPU's figures for a decode that is
memory-bound in the weights (c0: one read of the weights) and the KV cache (c_ctx), and a prefill
that is compute-bound (2 FLOPs a parameter a token); a calibrated machine (the CPU one) gives them
directly. Learner step: 6 FLOPs a parameter a token (forward and backward; 8 with the proximal
policy's extra forward) at an MFU, plus fixed costs. Weight push: an alpha-beta broadcast of the
weights in buckets (or of a sparse delta's indices and values), then each engine loads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCost:
    c0_s: float
    """Fixed cost of a step (weights read once, launch overheads)."""
    c_seq_s: float
    """Per running request (its token's share of the matmuls, sampling)."""
    c_ctx_s: float
    """Per token of context held by the running requests (its KV read)."""
    c_prefill_s: float
    """Per prompt token prefilled."""
    c_request_s: float = 0.0
    """Per request started (scheduling it, the actor's task, its stream): what a batch of short
    responses or an in-flight update's resumes pay beyond their tokens."""

    def scaled(self, factor: float) -> "EngineCost":
        """Every constant times `factor` (an engine slowed by sharing its cores)."""
        return EngineCost(self.c0_s * factor, self.c_seq_s * factor, self.c_ctx_s * factor, self.c_prefill_s * factor,
                          self.c_request_s * factor)

    def step_s(self, batch: int, context: int, prefill: int = 0) -> float:
        return self.c0_s + self.c_seq_s * batch + self.c_ctx_s * context + self.c_prefill_s * prefill

    def steps_s(self, k: int, batch: int, context: int, prefill: int = 0, started: int = 0) -> float:
        """Time of k steps of `batch` requests that start with `context` tokens (each step adds
        `batch`), the first one also prefilling `prefill` tokens of `started` new requests: sum
        over i < k of step_s(batch, context + i * batch), plus the first step's admissions."""
        per = self.c0_s + self.c_seq_s * batch + self.c_ctx_s * context
        first = self.c_prefill_s * prefill + self.c_request_s * started
        return first + k * per + self.c_ctx_s * batch * k * (k - 1) / 2

    def steps_done(self, elapsed_s: float, batch: int, context: int, prefill: int = 0, started: int = 0) -> int:
        """How many whole steps of `steps_s` fit in `elapsed_s` (the inverse of steps_s)."""
        a = self.c_ctx_s * batch / 2
        b = self.c0_s + self.c_seq_s * batch + self.c_ctx_s * context - a
        c = self.c_prefill_s * prefill + self.c_request_s * started - elapsed_s
        if c > 0:
            return 0
        k = -c / b if a == 0 else (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
        k = max(int(k), 0)
        while k > 0 and self.steps_s(k, batch, context, prefill, started) > elapsed_s:  # float rounding
            k -= 1
        while self.steps_s(k + 1, batch, context, prefill, started) <= elapsed_s:
            k += 1
        return k


def engine_cost_from_hardware(params: float, weight_bytes: float, kv_bytes_per_token: float, tp: int,
                              peak_flops: float, hbm_bytes_per_s: float, bandwidth_efficiency: float,
                              prefill_mfu: float, step_overhead_s: float) -> EngineCost:
    """Decode memory-bound (weights and KV read at `bandwidth_efficiency` of HBM bandwidth, split
    over tp GPUs), its per-request matmul share and the prefill compute-bound (2 FLOPs a parameter
    a token at `prefill_mfu`)."""
    bw = tp * hbm_bytes_per_s * bandwidth_efficiency
    per_token_flops_s = 2 * params / (tp * peak_flops * prefill_mfu)
    return EngineCost(c0_s=step_overhead_s + weight_bytes / bw, c_seq_s=per_token_flops_s,
                      c_ctx_s=kv_bytes_per_token / bw, c_prefill_s=per_token_flops_s)


def kv_capacity_tokens(tp: int, gpu_bytes: float, memory_utilization: float, weight_bytes: float,
                       kv_bytes_per_token: float) -> int:
    """Tokens of KV cache an engine of tp GPUs holds (vLLM: its memory share less the weights)."""
    free = tp * gpu_bytes * memory_utilization - weight_bytes
    if free <= 0:
        raise ValueError(f"the weights ({weight_bytes / 2**30:.1f} GiB) do not fit {tp} GPU(s) at "
                         f"memory utilization {memory_utilization}")
    return int(free // kv_bytes_per_token)


@dataclass(frozen=True)
class LearnerCost:
    params: float
    gpus: int
    peak_flops: float
    mfu: float
    flops_per_param_token: float = 6.0
    """6: forward and backward; 8 with a forward of the proximal policy (decoupled PPO)."""
    fixed_s: float = 0.0
    """Per step: optimizer, collectives' latency, batch loading."""
    per_token_s: float = 0.0
    """Calibrated machines: measured seconds a token beyond the FLOP model (0 on GPUs)."""

    def step_s(self, tokens: int) -> float:
        """One optimizer step over `tokens` tokens (prompts and responses, all forwarded)."""
        flops = self.flops_per_param_token * self.params * tokens
        return self.fixed_s + self.per_token_s * tokens + flops / (self.gpus * self.peak_flops * self.mfu)


@dataclass(frozen=True)
class PushCost:
    weight_bytes: float
    bucket_bytes: float
    alpha_s: float
    """Latency of one bucket's broadcast."""
    beta_bytes_per_s: float
    """Bandwidth of the slowest link the broadcast crosses."""
    load_bytes_per_s: float
    """How fast an engine copies received weights into its model."""
    fixed_s: float = 0.0
    """Per push: the engines' pause and resume calls, a prefix-cache reset."""
    changed_frac: float = 1.0
    """`sync.transfer: delta`: the share of the weights' elements a step changes in the engine's
    dtype (1: every push is whole, nothing compared). A delta carries a 2-byte position gap beside each changed element
    (asyncrl/sync/delta.py) and goes whole when that is no smaller."""
    bytes_per_param: float = 2.0
    encode_bytes_per_s: float = math.inf
    """`delta`: how fast the learner finds what changed (compares the weights in the engine's dtype
    with its copy of what the engines hold, gathers the changed elements), in weight bytes per
    second. Paid on every delta push, whatever little it then sends; a whole push skips it."""

    def payload_bytes(self, full: bool = False) -> float:
        """What a push moves: the weights, or a delta's position gaps and values."""
        if full:
            return self.weight_bytes
        per_element = (2 + self.bytes_per_param) / self.bytes_per_param
        return min(self.weight_bytes, self.weight_bytes * self.changed_frac * per_element)

    def buckets(self, full: bool = False) -> int:
        return max(1, math.ceil(self.payload_bytes(full) / self.bucket_bytes))

    def transfer_s(self, full: bool = False) -> float:
        """The learner's broadcast of every bucket (the engines receive it together)."""
        return self.buckets(full) * self.alpha_s + self.payload_bytes(full) / self.beta_bytes_per_s

    def encode_s(self, full: bool = False) -> float:
        """The learner's search for the changed elements before a delta's broadcast."""
        return 0.0 if full or self.changed_frac >= 1.0 else self.weight_bytes / self.encode_bytes_per_s

    def load_s(self) -> float:
        """The engines reload the whole weights even after a delta: a layer reloads once all its
        tensors are in (sync/vllm_gloo_engine.py)."""
        return self.weight_bytes / self.load_bytes_per_s

    def push_s(self, full: bool = False) -> float:
        """From the moment every engine is ready to receive until every engine computes with the
        new weights; `full`: the whole weights whatever `changed_frac` is."""
        return self.fixed_s + self.encode_s(full) + self.transfer_s(full) + self.load_s()
