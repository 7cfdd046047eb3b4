"""What determines a built tiny model (`TinyModelSpec`; its hash is the cache key) and the spec a
run's `model.tiny` section asks for. Apart from build.py so that what reads a spec (the
measurements, preflight) need not import the builder."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from asyncrl.config import TinyModelConfig
from asyncrl.tiny import task as tiny_task
from asyncrl.tiny import tool_task

FORMAT_VERSION = 2
"""Bump when the directory layout, tokenizer or training recipe changes: it is part of the key."""


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the built model; its hash is the cache key."""

    seed: int = 0
    """Seeds the init, the warm-start batches and the accuracy measurements."""
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    """hidden_size / num_heads must be a head size vLLM's CPU attention supports (32, 64, ...)."""
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_positions: int = 64
    """Context length; the tiny task needs under 20 tokens per sample."""
    warm_start_steps: int = 800
    """Length of the learning-rate schedule and the most steps trained (to convergence, greedy
    accuracy ~1, in about 60 s on 2 cores); target_sampled_accuracy usually stops far earlier."""
    batch_size: int = 64
    lr: float = 3e-3
    """AdamW peak learning rate (linear warmup over 5% of warm_start_steps, then linear decay to 10%)."""
    target_sampled_accuracy: float | None = 0.25
    """Stop training at the first check whose sampled accuracy on the train problems reaches this
    (None: train all warm_start_steps)."""
    check_every: int = 20
    """Steps between accuracy checks (a check costs about 0.3 s, a tenth of the steps between)."""
    check_samples_per_problem: int = 16
    """Samples of every train problem per check: 16 x 79 problems gives a standard error of 0.012
    at 0.25, well below the check-to-check rise of the accuracy itself (0.06 -> 0.15 -> 0.30)."""
    soften_to_probability: float | None = None
    """Optional softening after training (None: none): bake into the weights the temperature at
    which the exact probability of sampling the canonical right response, averaged over train
    problems, is this. Meant for target_sampled_accuracy=None (a converged model)."""
    task: tiny_task.TinyTaskSpec = dataclasses.field(default_factory=tiny_task.TinyTaskSpec)
    num_eval_prompts: int = 1000
    """Prompts drawn per split for the accuracies recorded in warm_start.json (SE about 0.015)."""
    tool: bool = False
    """Warm-start on the calculator task (tool_task.py: two-digit multiplication, answered by
    copying the operands into a calculator call and its result into the box) instead of `task`."""
    num_experts: int = 0
    """0: dense (Qwen2); more: Qwen3-MoE with this many experts a layer, each of width
    intermediate_size / experts_per_token, so a token's active MLP is as wide as the dense one's."""
    experts_per_token: int = 2
    architecture: str = "qwen2"
    """qwen2, or llama: the qwen2 build's weights under Llama's architecture (build.llama_twin), the
    same function, which vLLM serves LoRA adapters on the embedding and LM head for."""

    def key(self) -> str:
        """Stable short hash of the spec and the format version."""
        fields = dataclasses.asdict(self)
        if not self.tool:
            del fields["tool"]  # the arithmetic models keep the keys they were cached under
        if not self.num_experts:  # and the dense ones theirs
            del fields["num_experts"], fields["experts_per_token"]
        if self.architecture == "qwen2":
            del fields["architecture"]
        else:
            fields["tool_task"] = tool_task.VERSION
        blob = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def spec_for(cfg: TinyModelConfig) -> TinyModelSpec:
    """The spec a run's `model.tiny` section asks for (its defaults give TinyModelSpec())."""
    return dataclasses.replace(
        TinyModelSpec(), seed=cfg.seed, warm_start_steps=cfg.warm_start_steps, lr=cfg.lr,
        target_sampled_accuracy=cfg.target_sampled_accuracy, soften_to_probability=cfg.soften_to_probability,
        num_experts=cfg.num_experts, experts_per_token=cfg.experts_per_token, architecture=cfg.architecture,
        # the tool task's sampled accuracy leaps (0.005 to 0.415 in 20 steps measured): checked
        # every 5 steps, on 400 problems (a standard error of 0.02 at 0.25), it stops near the target
        **({"tool": True, "check_every": 5, "check_samples_per_problem": 1} if cfg.task == "calc_tool" else {}),
    )
