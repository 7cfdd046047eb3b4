"""The torch training backend: the plain module at one rank, FSDP2 (`fully_shard`) at several.

FSDP2 shards every decoder layer on its own and the rest (embeddings, final norm, LM head) as
the root group, so a forward all-gathers one layer at a time. The root's parameters stay
gathered from the forward until the backward is done (FSDP2 does not reshard the root after
forward), which is what lets `model_forward.py` apply the LM head to the gathered hidden rows
outside the model's forward.

FSDP2 reduce-scatters gradients as a mean over ranks; the loss is multiplied by the world size
so that the result is the sum (the loss is already normalized by the step's global counts).
Parameters, gradients and Adam's moments are DTensors sharded on dim 0; the full tensor of one
parameter at a time is gathered for pushes, the policy's Hugging Face files and tests, while
checkpoints save the moments' shards as they are (torch.distributed.checkpoint, rank.py).

Mixed precision (`compute_dtype` narrower than the parameters): parameters, gradients and Adam's
moments stay in their own dtype (float32 masters, so updates below a bf16 ulp still land) and
forwards run under `autocast(compute_dtype)`; FSDP2 also gathers parameters in the compute dtype
and reduces gradients in float32 (`MixedPrecisionPolicy`), halving the all-gather's bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any, ContextManager

import torch

from asyncrl.learner.backend import MOMENTS, NamedTensor
from asyncrl.learner.routers import routers


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) DTensor; collective for a DTensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (`model.model.layers` for Llama, Qwen,
    Mistral...); none found means the whole model is one FSDP group."""
    if hasattr(model, "get_base_model"):  # a peft model (learner.lora): its layers are the base's
        model = model.get_base_model()
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


class TorchBackend:
    def __init__(self, model: torch.nn.Module, cfg, world_size: int, compute_dtype: torch.dtype | None = None):
        self.world_size = world_size
        param_dtype = next(model.parameters()).dtype
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"  # the parameters may be on meta still
        # None: compute in the parameters' own dtype (no autocast)
        self.compute_dtype = compute_dtype if compute_dtype not in (None, param_dtype) else None
        if world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy

            self.mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world_size,))
            self.policy = (MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
                           if self.compute_dtype else MixedPrecisionPolicy())
            self.shard(model)
        self.module = model
        # On GPUs the fused kernel: one launch updates every parameter (torch's default there is the
        # multi-tensor foreach path); it needs its step counters on the GPU too (load_optimizer_state).
        # On CPU torch's default stays: the float64 gradient tests run there.
        self.fused = self.device_type == "cuda"
        # frozen parameters (a LoRA policy's base) have no moments to keep
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                           weight_decay=cfg.weight_decay, fused=self.fused or None)

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """Lay `model` out as the policy is: each decoder layer its own FSDP2 group, the rest the
        root (a frozen copy too: the reference policy). One rank: unchanged. Meta parameters
        stay meta (sharded_load.py gives them storage)."""
        if self.world_size == 1:
            return model
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for router in routers(model):  # gathered in float32 where they compute in it (routers.py)
            if getattr(router, "_asyncrl_fp32", False) and self.compute_dtype is not None:
                fully_shard(router, mesh=self.mesh, mp_policy=fp32)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=self.mesh, mp_policy=self.policy)
        fully_shard(model, mesh=self.mesh, mp_policy=self.policy)
        return model

    def autocast(self) -> ContextManager:
        """Where forwards run: autocast to the compute dtype over wider (master) parameters."""
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def expect_backwards(self, count: int) -> None:
        pass  # FSDP2 reduce-scatters in every backward; nothing waits for the last

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.world_size).backward() if self.world_size > 1 else loss.backward()

    def step(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(_full(norm))

    def param_specs(self, trainable_only: bool = False) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(name, p.shape, p.dtype) for name, p in self.module.named_parameters()  # a DTensor's shape is global
                if p.requires_grad or not trainable_only]

    def named_full_params(self, trainable_only: bool = False,
                          dtype: torch.dtype | None = None) -> Iterator[NamedTensor]:
        # named_parameters() yields a tied embedding once, under its input-embedding name
        for name, p in self.module.named_parameters():
            if p.requires_grad or not trainable_only:
                # a shard casts alone (element-wise: the same bits as casting the whole after)
                yield name, _full(p.detach() if dtype is None else p.detach().to(dtype))

    def full_grads(self) -> dict[str, torch.Tensor]:
        return {n: _full(p.grad) for n, p in self.module.named_parameters() if p.grad is not None}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.optimizer_steps(), "exp_avg": {}, "exp_avg_sq": {}}
        for name, p in self.module.named_parameters():
            state = self.optimizer.state.get(p)
            if state:  # this rank's shards as they are (DTensors): a sharded checkpoint gathers nothing
                out["exp_avg"][name] = state["exp_avg"]
                out["exp_avg_sq"][name] = state["exp_avg_sq"]
        return out

    def optimizer_template(self, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        params = dict(self.module.named_parameters())
        return {key: {name: torch.empty_like(params[name]) for name in names} for key in MOMENTS}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.state.clear()
        for name, p in self.module.named_parameters():
            if name in state["exp_avg"]:
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(state["step"]), device=p.device if self.fused else None),
                    "exp_avg": _like(p, state["exp_avg"][name]),
                    "exp_avg_sq": _like(p, state["exp_avg_sq"][name])}

    def reset_optimizer(self) -> None:
        self.optimizer.state.clear()

    def optimizer_steps(self) -> int:
        state = next(iter(self.optimizer.state.values()), {})
        return int(state.get("step", 0))


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a full tensor, or one already laid out like `param`) as `param` is laid out:
    this rank's shard of it when `param` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor) and isinstance(value, DTensor):
        if value.placements != param.placements:
            raise ValueError(f"optimizer state laid out as {value.placements}, the parameter as {param.placements}")
        return value.to(device=param.device, dtype=param.dtype)
    value = value.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(value, param.device_mesh, param.placements)
    return value.clone()
