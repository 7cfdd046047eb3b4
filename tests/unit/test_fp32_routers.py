"""MoE routers in float32 under bf16 autocast (learner/routers.py): their logits are the float32
matmul of their input, where autocast alone rounds them to bf16 (3 significant digits)."""

import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from asyncrl.learner.routers import routers, use_fp32_routers


def model():
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1)).eval()


def router_logits_and_exact(m):
    """Each router's logits under bf16 autocast, the float64 matmul of the input it got, and the
    float32 rounding bound of that matmul in any summation order: n u sum_i |x_i w_i| (n = 32
    terms, u = 2^-24)."""
    seen = []
    for r in routers(m):
        r.register_forward_hook(lambda mod, args, out: seen.append((out[0], args[0].reshape(-1, mod.hidden_dim),
                                                                    mod.weight)))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        m(input_ids=ids)
    return [(logits, x.double() @ w.double().T, 32 * 2.0**-24 * (x.double().abs() @ w.double().abs().T))
            for logits, x, w in seen]


def test_routers_compute_float32_logits_under_bf16_autocast():
    m = model()
    assert use_fp32_routers(m) == 2 and use_fp32_routers(m) == 2  # once each, however often asked
    for logits, exact, bound in router_logits_and_exact(m):
        assert logits.dtype == torch.float32
        assert bool(((logits.double() - exact).abs() <= bound).all())  # float32 rounding, any order


def test_without_them_autocast_rounds_router_logits_to_bf16():
    for logits, exact, bound in router_logits_and_exact(model()):
        assert logits.dtype == torch.bfloat16
        assert bool(((logits.double() - exact).abs() > bound).any())  # what the float32 routers remove
