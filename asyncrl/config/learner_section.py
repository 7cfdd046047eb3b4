"""The `learner` section of the config: the training backend and its ranks, the optimizer, the
micro-batching of a step and the parameter dtype."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from asyncrl.config.section import _Section

__all__ = ["DeepSpeedConfig", "LearnerConfig", "LoraConfig"]


class DeepSpeedConfig(_Section):
    stage: int = 2
    """ZeRO stage: 2 (optimizer state and gradients sharded) or 3 (parameters too)."""

    @field_validator("stage")
    @classmethod
    def _stage(cls, v: int) -> int:
        if v not in (2, 3):
            raise ValueError(f"ZeRO stage must be 2 or 3, got {v}")
        return v


class LoraConfig(_Section):
    rank: int = Field(0, ge=0, le=512)
    """LoRA rank r (at most 512, the largest vLLM serves); 0: off (every parameter trains). On: each targeted linear layer's frozen weight
    W is used as W + (alpha / r) B A with A [r, in] and B [out, r] trained (B starts at zero, so step
    0 is the base model); the base is held in the engines' dtype, the optimizer holds the adapter
    alone, and each push carries only the adapter (learner/lora.py)."""
    alpha: float = Field(32.0, gt=0)
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input. 0 keeps the learner's logprobs equal to the engines' (which
    apply none), as the ratio of every correction assumes."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Names of the linear layers to adapt (a module whose name ends with one of them, e.g.
    [q_proj, v_proj]), or `all-linear`: every linear layer of the decoder but the LM head."""
    save_merged: bool = False
    """Also write final/merged: the base with the adapter merged in, a plain Hugging Face model (final/
    itself holds the adapter in peft's format, which vLLM and transformers load on the base)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class LearnerConfig(_Section):
    backend: Literal["torch", "deepspeed"] = "torch"
    """Training backend: `torch` (the plain module at one rank, FSDP2 at several) or
    `deepspeed` (ZeRO stage `learner.deepspeed.stage`; `pip install deepspeed`)."""
    num_ranks: int = Field(1, ge=1)
    """Learner ranks, one process each, in one torch.distributed group (gloo on CPU, NCCL on GPU).
    The step's Φ loss tokens are split between them; the gradient is the single-rank one."""
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    """DeepSpeed settings (learner.backend=deepspeed)."""
    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon, added to the root of the second moment: a coordinate whose gradient is
    below it moves less than lr."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    micro_batch_tokens: int = Field(4096, gt=0)
    """Tokens (context included) per forward/backward; the step's gradient does not depend on it."""
    pack_sequences: bool = True
    """Micro-batches packed: the sequences back to back in one row, without padding, attention kept
    within each by restarting position ids (learner/collate.py). Checked at start against the
    padded layout on two short sequences: a model whose attention mixes packed sequences is run
    padded, with a warning. `learner/padding_frac` reports the padding left."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input for backward and recompute the layer there (Hugging
    Face's gradient checkpointing, non-reentrant): activation memory of one layer instead of all,
    for about a third more forward compute. On in the GPU recipes; the gradient is the same."""
    entropy_chunk_tokens: int = Field(1024, gt=0)
    """Tokens per chunk when computing logprobs and entropy over the vocabulary."""
    head_dtype: Literal["float32", "compute"] = "float32"
    """The LM head's matmul, softmax, logprobs and entropy, and a MoE model's router logits:
    float32 (outside autocast: bf16 logits are where the learner's policy and the engines' drift
    apart most, and bf16 router logits swap near-tied experts), or the compute dtype (model.dtype).
    The same on CPU, where the demo computes in float32 anyway."""
    recompute_head: bool = True
    """Recompute each chunk's head in backward (memory: a few [chunk, vocab] tensors), or keep
    the micro-batch's [loss tokens, vocab] log-softmax from the forward and evaluate the head once
    (algo/token_stats.py; 4 head matmuls become 3). Off in the GPU recipes."""
    offpolicy_metrics: bool = True
    """Decompose each step's tokens by staleness, entropy and response length (`offpolicy/`
    metrics, algo/token_decomposition.py): no extra forward, a few ms a step."""
    num_threads: int = Field(1, ge=1)
    """torch intra-op threads of a learner rank on CPU."""
    num_cpus: float = Field(1.0, gt=0)
    """Logical Ray CPUs per learner rank."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs per learner rank."""
    resources: dict[str, float] = {}
    """Custom Ray resources each learner rank asks for, e.g. {learner_node: 1} to put the ranks on
    the node started with `ray start --resources '{"learner_node": 8}'`."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Learner parameters, gradients and Adam moments (float32 masters keep updates below a bf16 ulp).
    With LoRA: the adapter's; the frozen base is held in the engines' dtype."""
    lora: LoraConfig = LoraConfig()
    """Low-rank adapters instead of full-parameter training (off while `lora.rank` is 0)."""
