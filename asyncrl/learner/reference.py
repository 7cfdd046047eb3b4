"""The reference policy pi_ref of the KL term, held by the learner (ProRL section 3.3).

A frozen copy of the policy at the start of the run, whole on every learner rank (never
sharded: its forward is local). A reference reset (ProRL section 3.3.1) copies the current
policy into it, one gathered parameter at a time; the caller also resets the optimizer state,
since Adam's moments describe a trajectory the reset has just cut.
"""

from __future__ import annotations

import copy

import torch

from asyncrl.learner.collate import MicroBatch
from asyncrl.learner.model_forward import policy_forward


class ReferencePolicy:
    def __init__(self, policy: torch.nn.Module, chunk: int, device: torch.device, head_fp32: bool = False):
        self.model = copy.deepcopy(policy).eval()
        self.model.requires_grad_(False)
        self.chunk, self.device, self.head_fp32 = chunk, device, head_fp32
        self.num_resets = 0

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """log pi_ref of mb's loss tokens [T], at the sampling temperature like the policy's."""
        return policy_forward(self.model, mb, self.chunk, self.device, head_fp32=self.head_fp32).logprobs

    @torch.no_grad()
    def reset_from(self, named_params) -> None:
        """Copy the policy's full parameters, (name, tensor) pairs (gathered from shards one at a
        time on a sharded learner), into the reference."""
        own = dict(self.model.named_parameters())
        for name, tensor in named_params:
            own[name].copy_(tensor)
        self.num_resets += 1

    def restore_resets(self, num_resets: int) -> None:
        """A checkpoint's count of resets (its weights are loaded into `model` apart)."""
        self.num_resets = num_resets
