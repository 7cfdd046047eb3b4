"""MoE routers in float32 under a narrower compute dtype.

A router's logits choose each token's experts: under bf16 autocast two logits closer than a
bf16 step (3 significant digits) tie or swap, and the learner routes tokens to other experts than
the engine that sampled them did, a trainer/sampler mismatch no importance ratio accounts for.
So, with `learner.head_dtype: float32` (the LM head's rule, model_forward.TokenHead), every
router computes its logits in float32: autocast is off inside it, its input is upcast, and under
FSDP2 its weight is gathered in float32 (its own group, `TorchBackend.shard`) while the rest of
the layer is gathered in the compute dtype.

Routers are found by class name: Hugging Face's MoE models (Qwen2-MoE, Qwen3-MoE, Mixtral,
OLMoE...) name theirs `...Router` (e.g. `Qwen2MoeTopKRouter`), a module whose forward takes the
hidden states first.
"""

from __future__ import annotations

import functools

import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Router")]


def use_fp32_routers(model: torch.nn.Module) -> int:
    """Make every router of `model` compute in float32 (at least); returns how many there are."""
    found = routers(model)
    for router in found:
        if getattr(router, "_asyncrl_fp32", False):
            continue
        router.forward = functools.partial(_fp32_forward, router.forward)
        router._asyncrl_fp32 = True
    return len(found)


def _fp32_forward(forward, hidden_states, *args, **kwargs):
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    with torch.autocast(hidden_states.device.type, enabled=False):
        return forward(hidden_states.to(dtype), *args, **kwargs)
