"""The training backend of a learner rank: what wraps the model, reduces gradients across ranks,
steps the optimizer and gathers full tensors from shards. One protocol (here), two
implementations, picked by `make_backend` (the package's face, asyncrl/learner/__init__.py):

- `torch_backend.py`: the plain module at one rank, FSDP2 (`fully_shard`) at several;
- `deepspeed_backend.py`: DeepSpeed ZeRO stage 2 or 3 (the only module that imports deepspeed).

Everything else in a step (micro-batches, the loss, metrics) is the rank's and the same for all
backends (`rank.py`, `policy_step.py`).

Gradients are *summed* over ranks, not averaged: every rank's loss is already normalized by
the step's global counts (Φ loss tokens, sequences), so the sum of the ranks' gradients is the
single-rank gradient. Both FSDP2 and DeepSpeed average by default; the backends undo it.

Calls marked *collective* must be made by every rank of the learner group in the same order
(they all-gather shards): the rank runs them on every rank, rank 0 uses the result.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, ContextManager, Protocol

import torch

from asyncrl.sync.wire import interface_of, store_at

NamedTensor = tuple[str, torch.Tensor]
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's, by the names torch's AdamW keeps them under


class TrainBackend(Protocol):
    module: torch.nn.Module
    """What forwards run through (the wrapped model)."""

    def autocast(self) -> ContextManager:
        """The context every forward runs in (bf16 autocast over fp32 master weights, or none)."""

    def expect_backwards(self, count: int) -> None:
        """How many `backward` calls the coming step makes (the last is where ZeRO reduces)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss` (one micro-batch); summed over ranks at the step."""

    def step(self, max_norm: float) -> float:
        """Clip the global gradient norm, step the optimizer, zero the gradients; returns the
        norm before clipping (over all ranks' summed gradient)."""

    def param_specs(self, trainable_only: bool = False) -> list[tuple[str, torch.Size, torch.dtype]]:
        """(name, full shape, dtype) of every parameter, in `named_full_params` order; no gathering."""

    def named_full_params(self, trainable_only: bool = False,
                          dtype: torch.dtype | None = None) -> Iterator[NamedTensor]:
        """Collective. Full parameters, one at a time, in `named_parameters()` order (a tied
        weight once, under its first name); only one parameter is gathered at a time.
        `trainable_only`: those that train (a LoRA policy's adapter), in the same order.
        `dtype`: cast to it (a push's engine dtype), before the gather where the backend can:
        a bf16 push then gathers half the bytes of the float32 parameters."""

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Collective. The accumulated full gradients (after backward, before `step`)."""

    def zero_grad(self) -> None:
        """Drop the accumulated gradients without stepping."""

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """Lay a frozen copy of the policy (the reference) out as the policy is: sharded the same
        way by FSDP2, unchanged where the backend holds whole models on every rank."""

    def optimizer_state(self) -> dict[str, Any]:
        """Collective where it gathers. The optimizer's state by parameter name:
        {"step": int, "exp_avg": {name: tensor}, "exp_avg_sq": {name: tensor}} (empty dicts
        before the first step), each tensor this rank's shard where parameters are DTensors
        (FSDP2), else the full tensor; torch.distributed.checkpoint saves either kind and loads
        it onto any number of ranks."""

    def optimizer_template(self, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """{"exp_avg": {name: tensor}, "exp_avg_sq": {...}} for `names`, laid out as
        `optimizer_state` lays them out, for a checkpoint load to fill in place."""

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Collective. Load a state shaped as `optimizer_state`'s, on any number of ranks: each
        tensor full, or laid out as this backend's `optimizer_template` is."""

    def reset_optimizer(self) -> None:
        """Forget the optimizer's moments and step count (a reference reset)."""

    def optimizer_steps(self) -> int:
        """The optimizer's step count (0 after a reset)."""


def init_process_group(rank: int, world_size: int, address: str, timeout_s: float = 600.0,
                       local_host: str | None = None) -> None:
    """Join the learner group (the default process group): NCCL on GPUs, gloo on CPU. A single
    rank needs none, but joins one too so every rank runs the same code. `local_host`: this rank's
    node address, which gloo's connections use (unless GLOO_SOCKET_IFNAME says otherwise)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # what torchrun would set, and DeepSpeed reads; under Ray a GPU rank sees its one GPU as cuda:0
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK="0" if torch.cuda.is_available() else str(rank))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo" and local_host and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo otherwise advertises what the hostname resolves to (127.0.0.1 on many machines),
        # and ranks on other nodes would dial themselves
        iface = interface_of(local_host)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    host, port = address.rsplit(":", 1)  # rank 0's node: its store listens there alone (store_at)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store_at(host, int(port), world_size, rank == 0, timeout), rank=rank,
                            world_size=world_size, timeout=timeout)
