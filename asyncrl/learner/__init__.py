"""A learner rank (rank.py) and its training backends; `make_backend` picks the backend, the
protocol is backend.py's.
"""

from __future__ import annotations

import os

import torch

from asyncrl.learner.backend import TrainBackend


def make_backend(kind: str, model: torch.nn.Module, learner_cfg, world_size: int,
                 compute_dtype: torch.dtype | None = None) -> TrainBackend:
    """The backend `learner.backend` names, around `model` (already on this rank's device, in
    the parameter dtype); forwards compute in `compute_dtype` (None: the parameters' dtype)."""
    if kind == "torch":
        from asyncrl.learner.torch_backend import TorchBackend

        return TorchBackend(model, learner_cfg, world_size, compute_dtype)
    if kind == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        from asyncrl.learner.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(model, learner_cfg, world_size, compute_dtype)
    raise ValueError(f"learner.backend must be 'torch' or 'deepspeed', got {kind!r}")
