"""The learner's policy as Hugging Face files, written from full tensors gathered off the shards.

`save_pretrained` on a wrapped model would name the wrapper's class (FSDP renames it) in
config.json, which vLLM cannot load; so the config is the one read at start, saved as is, and
the weights go to safetensors files written as the tensors arrive (one gathered parameter at a
time): the writer holds at most one file's worth (`max_file_bytes`), never the whole model.
Several files are named and indexed as `save_pretrained` names them
(model-00001-of-00003.safetensors and model.safetensors.index.json); one is model.safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

MAX_FILE_BYTES = 2 << 30


def save_hf_model(out: Path, tensors: Iterable[tuple[str, torch.Tensor]], config, generation_config=None,
                  max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """Write `tensors` (name, tensor) as they come, in files of at most `max_file_bytes` (a larger
    tensor gets a file of its own), with the config (and generation config)."""
    from safetensors.torch import save_file

    config.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # an overwritten directory must not keep the last save's files
    files: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        if pending:
            save_file(pending, str(out / f"part-{len(files)}.safetensors"), metadata={"format": "pt"})
            files.append(list(pending))
            pending.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > max_file_bytes:
            flush()
            size = 0
        pending[name] = tensor.detach().cpu().contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(files) == 1:
        (out / "part-0.safetensors").rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (out / f"part-{i}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def meta_params(specs) -> list[tuple[str, torch.Tensor]]:
    """(name, shape, dtype) specs as storage-less tensors: what a weight-sync plan is made from."""
    return [(name, torch.empty(tuple(shape), dtype=dtype, device="meta")) for name, shape, dtype in specs]
