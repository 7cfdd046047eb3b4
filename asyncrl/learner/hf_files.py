"""The learner's policy as Hugging Face files, written from full tensors gathered off the shards.

`save_pretrained` on a wrapped model would name the wrapper's class (FSDP renames it) in
config.json, which vLLM cannot load; so the config is the one read at start, saved as is,
and the weights go to model.safetensors.
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_hf_model(out: Path, state: dict[str, torch.Tensor], config, generation_config=None) -> None:
    from safetensors.torch import save_file

    config.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def meta_params(specs) -> list[tuple[str, torch.Tensor]]:
    """(name, shape, dtype) specs as storage-less tensors: what a weight-sync plan is made from."""
    return [(name, torch.empty(tuple(shape), dtype=dtype, device="meta")) for name, shape, dtype in specs]
