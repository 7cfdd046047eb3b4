"""The reference policy pi_ref of the KL term, held by the learner (ProRL section 3.3).

A frozen copy of the policy at the start of the run, laid out as the policy is (`place`): sharded
the same way under FSDP2, so it costs each rank its share, not a whole model; whole on every rank
otherwise. A reference reset (ProRL section 3.3.1) copies the current policy into it: shard into
shard where both are sharded, else one gathered parameter at a time. The caller also resets the
optimizer state, since Adam's moments describe a trajectory the reset has just cut.
"""

from __future__ import annotations

import copy

import torch

from asyncrl.learner.collate import MicroBatch
from asyncrl.learner.lora import adapter_off, adapter_swapped
from asyncrl.learner.model_forward import policy_forward
from asyncrl.learner.sharded_load import materialize


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class ReferencePolicy:
    before_backward = False  # its own model: its forwards run beside the policy's (AdapterReference's do not)

    def __init__(self, policy: torch.nn.Module, chunk: int, device: torch.device, head_fp32: bool = False):
        """A copy of `policy` (before any sharding; on the meta device if the policy is), unplaced."""
        self.model = copy.deepcopy(policy).eval()
        self.model.requires_grad_(False)
        self.chunk, self.device, self.head_fp32 = chunk, device, head_fp32
        self.num_resets = 0

    def place(self, backend) -> None:
        """Lay the copy out as the backend lays out the policy; a copy made on the meta device
        gets storage and the policy's weights (`backend.module`'s, already loaded)."""
        self.model = backend.shard(self.model)
        if next(self.model.parameters()).device.type == "meta":
            policy = dict(backend.module.named_parameters())
            materialize(self.model, self.device, lambda name, local, _: local.copy_(_local(policy[name])))

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """log pi_ref of mb's loss tokens [T], at the sampling temperature like the policy's."""
        out = policy_forward(self.model, mb, self.chunk, self.device, head_fp32=self.head_fp32).logprobs
        reshard = getattr(self.model, "reshard", None)
        if reshard is not None:  # FSDP2 keeps its root gathered after a forward, for a backward that never comes
            reshard()
        return out

    @torch.no_grad()
    def reset_from(self, named_params) -> None:
        """Copy the policy's parameters, (name, tensor) pairs, into the reference: each rank's own
        shard when both are sharded, else full tensors (gathered one at a time by the caller)."""
        own = dict(self.model.named_parameters())
        for name, tensor in named_params:
            _local(own[name]).copy_(_local(tensor))
        self.num_resets += 1

    @property
    def sharded(self) -> bool:
        return any(_is_dtensor(p) for p in self.model.parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def restore_resets(self, num_resets: int) -> None:
        """A checkpoint's count of resets (its weights are loaded into `model` apart)."""
        self.num_resets = num_resets


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


class AdapterReference:
    """The reference of a LoRA policy (learner/lora.py), with no second model: the policy's own
    forward with the adapter switched off (the base), or, after a reset, with the adapter's weights
    at the reset swapped in. The snapshot is the adapter alone (laid out as the policy's, shards
    where it is sharded): a few MB where ReferencePolicy holds a whole model. `sharded` is True
    because the reference always runs through the policy's own (possibly sharded) module: a
    padding micro-batch runs it too, and a reset copies shard to shard. `before_backward`: a swap
    writes the adapter's weights in place, which a forward's pending graph must not see, so the
    step computes all its reference logprobs before its first policy forward (step.py)."""

    sharded = True
    before_backward = True

    def __init__(self, backend, chunk: int, device: torch.device, head_fp32: bool = False):
        self.backend, self.chunk, self.device, self.head_fp32 = backend, chunk, device, head_fp32
        self.snapshot = {n: p.detach().clone() for n, p in backend.module.named_parameters() if p.requires_grad}
        self.num_resets = 0

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        model = self.backend.module
        scope = adapter_swapped(model, {n: _local(t) for n, t in self.snapshot.items()}) if self.num_resets \
            else adapter_off(model)
        with scope:
            out = policy_forward(model, mb, self.chunk, self.device, head_fp32=self.head_fp32).logprobs
        reshard = getattr(model, "reshard", None)
        if reshard is not None:  # as ReferencePolicy: no backward comes for this forward
            reshard()
        return out

    @torch.no_grad()
    def reset_from(self, named_params) -> None:
        for name, tensor in named_params:
            if name in self.snapshot:
                if hasattr(tensor, "ds_numel"):  # a ZeRO-3 partition: no rank holds the whole adapter here
                    raise ValueError("a LoRA policy's KL reference cannot be reset under DeepSpeed ZeRO-3; "
                                     "use stage 2 or learner.backend=torch")
                _local(self.snapshot[name]).copy_(_local(tensor))
        self.num_resets += 1

    def restore_resets(self, num_resets: int) -> None:
        self.num_resets = num_resets

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.snapshot

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in state.items():
                _local(self.snapshot[name]).copy_(_local(tensor))
