"""The `sync` section of the config: how the learner pushes weights to the engines (transport,
schedule, in-flight mode, deltas, timeouts) and the parity probe that checks them, with the
probe's tolerance from the learner's and the engines' dtypes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.config.section import _Section


class SyncConfig(_Section):
    type: Literal["gloo", "nccl"] = "gloo"
    """Weight-transfer backend: gloo on CPU, NCCL (vLLM's engine) on GPUs."""
    every_steps: int = Field(1, ge=1)
    """Push weights to the actors every this many optimizer steps."""
    mode: Literal["drain", "inflight"] = "inflight"
    """inflight: abort running requests, load, resume each from the tokens it had (a response's
    tokens carry the version that generated each); drain: let running requests finish, then load."""
    keep_kv: bool = False
    """inflight only: pause the running requests with their KV cache instead of aborting them, and
    decode on with the new weights after the load (no prefill of prompt and prefix again). The
    tokens after the load are the new policy's samples, computed over keys and values the old one
    wrote: a mismatch the per-token metrics measure (docs/guides/sync-modes.md)."""
    bucket_mb: int = Field(256, gt=0)
    """Largest bucket of parameters broadcast at once."""
    transfer: Literal["full", "delta"] = "full"
    """full: every push carries every bucket; delta (gloo only): the learner keeps a copy of what the
    engines hold (in their dtype) and sends, per bucket, only the elements whose bits changed, or the
    whole bucket when that is smaller (docs/guides/weight-sync.md). Every push carries a checksum per
    bucket either way, and an engine that fails one gets a whole push at once."""
    full_every: int = Field(100, ge=0)
    """delta: one push in this many is whole (0: only the first after the group forms, and those
    that heal a failed checksum)."""
    timeout_s: float = Field(120.0, gt=0)
    """A push that takes longer fails loudly with the step and peer."""
    start_timeout_s: float = Field(600.0, gt=0)
    """How long the weight-sync group may take to form when the run starts: a component may still
    be busy with a one-time build then (DeepSpeed compiles its optimizer op on first use, minutes
    on a loaded machine). Past it the run stops with one line naming this field."""
    probe_every: int = Field(0, ge=0)
    """Check actor/learner logprob parity every this many pushes (0: never)."""
    probe_tolerance: float | None = Field(None, gt=0)
    """Parity tolerance in nats; a larger gap raises. None: from the learner's and the engines'
    dtypes, each side's measured rounding floor added up (`parity_tolerance`): 1e-4 with both in
    float32, 0.28 with one side in bf16, 0.56 with both (a bf16 probe catches a push that did not
    apply only where it moved some logprob by more than that)."""


# The largest per-token gap between a model's logprobs in this dtype and in float32, in nats, as
# the parity probe scores a sample (teacher-forced, the model's own head), measured with
# tools/parity_floor.py (docs/guides/sync-modes.md). bfloat16: 0.276 on the tiny agent's model
# (7,606 tokens of its own samples; 0.080 on the tiny model's 3,432), rounded up. float16 keeps 3
# more mantissa bits and takes bf16's floor as a bound. float32: two float32 implementations agree
# to ~1e-6; 5e-5 a side keeps the 1e-4 that every float32 test holds.
ROUNDING_FLOOR_NATS = {"float32": 5e-5, "bfloat16": 0.28, "float16": 0.28, "float64": 5e-5}


def parity_tolerance(learner_dtype: str, engine_dtype: str) -> float:
    """The parity probe's tolerance between a learner computing in `learner_dtype` and engines in
    `engine_dtype`: each side's rounding floor, added (each may round the other way)."""
    return ROUNDING_FLOOR_NATS[learner_dtype] + ROUNDING_FLOOR_NATS[engine_dtype]
