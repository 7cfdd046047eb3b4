"""The DeepSpeed training backend: ZeRO stage 2 (optimizer state and gradients partitioned over
ranks) or 3 (parameters too). The only module that imports deepspeed.

- The learner group is already the default process group when this starts; DeepSpeed joins it
  (`dist_init_required=False`) rather than running its own launcher's rendezvous.
- Optimizer: torch's AdamW (its multi-tensor "foreach" kernels on GPU: ZeRO hands it one flat
  partition per group, so there is little left for a fused kernel to save). Not DeepSpeed's
  FusedAdam: it JIT-builds a CUDA op with nvcc, which a CUDA runtime without the toolkit lacks,
  and on the H100 we ran on, where nvcc was there, the build failed before compiling (DeepSpeed
  0.19.8 cannot parse torch's "9.0a" architecture). Not torch's fused AdamW either: under ZeRO
  its step counters were on the CPU and the fused kernel refused them (same run).
- bf16 compute (`compute_dtype`): DeepSpeed's bf16 mode casts the module to bf16 and keeps the
  float32 masters in the optimizer; full parameters (pushes, checkpoints) are read from the
  masters, so a checkpoint holds what training continues from. DeepSpeed makes those masters
  from the module's bf16 copy (2.4e-4 off on a small model), so the loaded float32 weights are
  written back into them after `initialize`: a resumed run continues from its exact masters.
- A step is a variable number of backward calls (micro-batches, then padding) and one `step`.
  The rank says how many are coming (`expect_backwards`), and the last one is marked as the
  gradient-accumulation boundary, where ZeRO reduces and the optimizer may step.
- DeepSpeed averages gradients over ranks; the loss is multiplied by the world size so that
  the reduction is a sum (every rank's loss is already normalized by the step's global counts).
- ZeRO-3 gathers a layer's parameters only inside that module's forward. The LM head is applied
  to the loss positions outside the model's forward (model_forward.py), so the head's weight is
  registered as an external parameter of a `TokenHead` module attached to the model.
- ZeRO-3 records the order of its parameter gathers, forward and backward, and checks it with
  the other ranks (a broadcast) on the first forwards and whenever a step's order differs from
  the record. A backward gathers a module once per output of it that gets a gradient, so a
  padding micro-batch's loss reaches the same outputs as a real one's (`padding_loss` in
  policy_step.py); otherwise its rank alone checks while the others reduce: a hang.
- On CPU, DeepSpeed's communication backend would JIT-compile a shared-memory all-reduce op at
  its first start (g++ and ninja; 25 s on 2 cores, once per machine). Only its inference
  all-reduce uses that op, never training's collectives, so it is not built
  (`skip_inference_shm_op`).
- Full tensors (pushes, checkpoints, tests) come from the partitions one parameter at a time
  (`GatheredParameters`, `safe_get_full_*`).
- Optimizer state is checkpointed by parameter name, as FSDP2's is: each moment is gathered
  whole one parameter at a time and each rank keeps its rows of it (a DTensor sharded on dim 0
  over the learner group), so no rank ever holds the whole state and every rank writes its own
  rows (torch.distributed.checkpoint). ZeRO's own partitions are slices of flattened parameter
  groups, which no other layout could read; rows by name load on any number of ranks, in either
  backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any, ContextManager

import torch

from asyncrl.learner.backend import MOMENTS, NamedTensor
from asyncrl.learner.model_forward import TokenHead

try:
    import deepspeed
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_optimizer_state)
except ImportError as e:  # preflight says this first; here for a learner built in code
    raise ImportError("learner.backend=deepspeed needs DeepSpeed: pip install deepspeed") from e


def skip_inference_shm_op() -> None:
    """Before DeepSpeed's communication backend starts: it would build its shared-memory
    all-reduce op (the module docstring), which `inference_all_reduce` alone uses and which
    without the op falls back to the process group's all-reduce."""
    # the module itself: the attribute `deepspeed.comm.torch` is torch (deepspeed.comm re-exports it)
    ds_comm = importlib.import_module("deepspeed.comm.torch")
    if callable(getattr(ds_comm, "build_shm_op", None)):  # a DeepSpeed that lacks it builds nothing
        ds_comm.build_shm_op = lambda: None


def adamw_params(cfg) -> dict:
    """DeepSpeed's AdamW section: torch's AdamW, on CPU and GPU (see the module docstring)."""
    return {"lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
            "torch_adam": True}


class DeepSpeedBackend:
    def __init__(self, model: torch.nn.Module, cfg, world_size: int, compute_dtype: torch.dtype | None = None):
        self.world_size, self.stage = world_size, cfg.deepspeed.stage
        if next(model.parameters()).dtype != torch.float32:
            raise ValueError("learner.backend=deepspeed keeps float32 master weights: load the model in float32 "
                             "(learner.param_dtype=float32) and set the compute dtype (model.dtype)")
        self.bf16 = compute_dtype == torch.bfloat16
        # the loaded float32 weights, before DeepSpeed's bf16 cast rounds them (restored below)
        # (trained ones only: a LoRA policy's frozen base has no master copy)
        loaded = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()
                  if p.requires_grad} if self.bf16 else {}
        head = TokenHead(model.get_output_embeddings())
        model.add_module("token_head", head)  # before initialize: ZeRO-3 puts its hooks on it
        config = {
            "train_micro_batch_size_per_gpu": 1,  # unused: batches are ours
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": {"stage": self.stage},
            "optimizer": {"type": "AdamW", "params": adamw_params(cfg)},
            "bf16": {"enabled": self.bf16},
            "steps_per_print": 2**31 - 1,
        }
        skip_inference_shm_op()
        self.module, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config,
            dist_init_required=False)
        if self.stage == 3:
            for p in head.head.parameters():  # the weight, and a LoRA head's adapter
                deepspeed.zero.register_external_parameter(head, p)
        self.model = model
        for name, p in self._params(trainable_only=True) if self.bf16 else ():
            safe_set_full_fp32_param(p, loaded.pop(name).to(p.device))
        self._expected, self._calls = 1, 0
        self._reset_steps = False

    # -- a step ---------------------------------------------------------------------------------

    def autocast(self) -> ContextManager:
        return nullcontext()  # in bf16 mode the module itself is bf16

    def expect_backwards(self, count: int) -> None:
        self._expected, self._calls = max(count, 1), 0

    def backward(self, loss: torch.Tensor) -> None:
        self._calls += 1
        self.module.set_gradient_accumulation_boundary(self._calls >= self._expected)
        self.module.backward(loss * self.world_size)

    def step(self, max_norm: float) -> float:
        # clipping to learner.grad_clip is DeepSpeed's (gradient_clipping); max_norm is the same value
        self.module.set_gradient_accumulation_boundary(True)
        self.module.step()
        self._calls = 0
        norm = self.module.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self.module.zero_grad()
        self._calls = 0

    # -- full tensors (collective) ----------------------------------------------------------------

    def _params(self, trainable_only: bool = False):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad or not trainable_only]

    def param_specs(self, trainable_only: bool = False) -> list[tuple[str, torch.Size, torch.dtype]]:
        dtype = (lambda p: torch.float32) if self.bf16 else (lambda p: p.dtype)
        return [(n, torch.Size(getattr(p, "ds_shape", p.shape)), dtype(p)) for n, p in self._params(trainable_only)]

    def named_full_params(self, trainable_only: bool = False,
                          dtype: torch.dtype | None = None) -> Iterator[NamedTensor]:
        # cast after the gather: the masters are gathered as ZeRO holds them (float32)
        for name, p in self._params(trainable_only):
            if self.bf16 and p.requires_grad:  # the float32 master, not the module's bf16 copy (frozen: none)
                full = safe_get_full_fp32_param(p).detach().clone()
            elif self.stage == 3:
                with deepspeed.zero.GatheredParameters([p]):
                    full = p.detach().clone()
            else:
                full = p.detach()
            yield name, full if dtype is None else full.to(dtype)

    def full_grads(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self._params():
            g = safe_get_full_grad(p)
            if g is not None:
                out[name] = g.detach().clone()
        return out

    # -- optimizer state ------------------------------------------------------------------------

    def _inner_states(self) -> list[dict]:
        """The wrapped torch optimizer's per-partition states (where `step` lives)."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return [s for s in inner.state.values() if s]

    def optimizer_steps(self) -> int:
        states = self._inner_states()
        if not states:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            return int(inner.param_groups[0].get("step", 0))
        return int(states[0].get("step", 0))

    def optimizer_state(self) -> dict[str, Any]:
        steps = self.optimizer_steps()
        out: dict[str, Any] = {"step": steps, "exp_avg": {}, "exp_avg_sq": {}}
        if steps == 0:
            return out
        for name, p in self._params():
            for key in MOMENTS:
                value = safe_get_full_optimizer_state(p, key)  # collective; whole on every rank, one at a time
                if value is not None:
                    out[key][name] = self._own_rows(value.detach())
        return out

    def _rows_mesh(self):
        if getattr(self, "_mesh", None) is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (self.world_size,))
        return self._mesh

    def _own_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole moment, as a DTensor sharded on dim 0 (one rank: the whole
        tensor), copied to the CPU so that the whole tensor is freed."""
        from torch.distributed.tensor import Shard, distribute_tensor

        if self.world_size == 1:
            return full.cpu().clone()
        return _on_cpu(distribute_tensor(full, self._rows_mesh(), [Shard(0)], src_data_rank=None))  # a slice, no traffic

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # the reference stays whole on every rank: a ZeRO engine wraps one model only

    def optimizer_template(self, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Laid out as `optimizer_state` lays the moments out: each rank allocates its rows only."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor import empty as sharded_empty

        shapes = {name: shape for name, shape, _ in self.param_specs()}

        def rows(shape):
            if self.world_size == 1:
                return torch.empty(shape, dtype=torch.float32)
            return _on_cpu(sharded_empty(shape, dtype=torch.float32, device_mesh=self._rows_mesh(), placements=[Shard(0)]))

        return {key: {name: rows(shapes[name]) for name in names} for key in MOMENTS}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Each moment whole (an older checkpoint, or one rank's) or as rows (`_own_rows`),
        gathered one parameter at a time for ZeRO to take its partition."""
        from torch.distributed.tensor import DTensor

        if not state["exp_avg"]:
            self.reset_optimizer()
            return
        self._create_moments()
        for name, p in self._params():
            for key in MOMENTS:
                if name in state[key]:
                    value = state[key][name]
                    if isinstance(value, DTensor):
                        value = value.to(p.device).full_tensor()  # collective, in the same order on every rank
                    safe_set_full_optimizer_state(p, value.to(p.device), key)
        self._set_steps(int(state["step"]))

    def _create_moments(self) -> None:
        """torch's AdamW creates its moments at its first step, under ZeRO too (one pair per flat
        partition); ZeRO-1/2 then link each parameter to its slice of them. A run resumed before
        any step creates them (zeros, overwritten by the load) and links them as that step would."""
        zero = self.optimizer
        flats = zero.fp32_partitioned_groups_flat if self.stage == 3 else zero.single_partition_of_fp32_groups
        missing = [flat for flat in flats if "exp_avg" not in zero.optimizer.state.get(flat, {})]
        for flat in missing:
            zero.optimizer.state[flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                          "exp_avg_sq": torch.zeros_like(flat)}
        if missing and self.stage < 3:
            zero._lazy_init_hp_params_optimizer_state()

    def reset_optimizer(self) -> None:
        for s in self._inner_states():
            for key in MOMENTS:
                if key in s:
                    s[key].zero_()
        self._set_steps(0)

    def _set_steps(self, steps: int) -> None:
        for s in self._inner_states():
            if "step" in s:
                s["step"] = torch.tensor(float(steps)) if torch.is_tensor(s["step"]) else steps
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = steps


def _on_cpu(rows):
    """A DTensor with its local rows copied to the CPU (checkpoints are written from there)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(rows.to_local().cpu().clone(), rows.device_mesh, rows.placements,
                              shape=rows.shape, stride=rows.stride())
