"""A sharded policy built without any rank ever holding the whole model.

`from_pretrained` on every rank, then sharding, peaks at the full model per rank (per process:
eight copies of a 7B model's fp32 weights on an 8-GPU node's host memory). Here instead:

1. `meta_model`: the model class is built on the meta device: parameters have shapes and no
   storage. Buffers are built for real, because they are computed, not loaded (rotary
   frequencies are not in the checkpoint).
2. The backend shards the meta parameters (FSDP2's `fully_shard` accepts them).
3. `materialize`: each rank allocates its own shard and reads only its rows of every parameter
   from the safetensors files (`get_slice` reads just those bytes). No rank reads or receives
   another's rows, and no collective is needed.

MoE checkpoints keep one module per expert (`mlp.experts.<e>.gate_proj.weight`, ...), where
transformers 5 fuses a layer's experts into one tensor per projection as it loads them (what its
conversion mapping does for the Qwen-MoE and DeepSeek families, and for Mixtral's w1/w3/w2):
`experts.gate_up_proj` [E, 2I, H] holds, in row e, expert e's gate projection's weight stacked over
its up projection's, and `experts.down_proj` [E, H, I] expert e's down projection's. FSDP2 shards
such a tensor by experts, so a rank reads the files of its own experts only (`expert_pieces`).

`missing_from_files` says when this cannot work: a checkpoint whose tensors are neither the
model's parameters nor such experts (Hugging Face renames some on load). The learner then loads
the whole model on every rank as before, and says so.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch


def weight_files(model_path: str) -> list[Path]:
    """The safetensors files of a Hugging Face directory (one file, or the shards an index lists)."""
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = root / "model.safetensors"
    return [single] if single.is_file() else []


def file_shapes(model_path: str) -> dict[str, tuple[tuple[int, ...], Path]]:
    """name -> (shape, file) for every tensor in the checkpoint, from the files' headers alone."""
    from safetensors import safe_open

    out = {}
    for path in weight_files(model_path):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                out[name] = (tuple(f.get_slice(name).get_shape()), path)
    return out


@contextmanager
def parameters_on_meta():
    """Every parameter registered inside is moved to the meta device as it is registered
    (buffers are left alone): what `accelerate.init_empty_weights(include_buffers=False)` does."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def meta_model(model_path: str, dtype: torch.dtype, **kwargs) -> torch.nn.Module:
    """The causal LM of `model_path` with storage-less parameters in `dtype` and real buffers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)


# fused experts parameter -> the per-expert tensors stacked into each of its rows, by naming scheme
FUSED_EXPERTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


def expert_pieces(name: str, shape: tuple[int, ...], files: dict) -> list[tuple[str, ...]] | None:
    """For a fused experts parameter (module docstring) that `files` (file_shapes) holds one
    expert at a time: per expert, the names of the tensors whose stack on their first dimension is
    its row. None when `name` is no such parameter, or the files' names or shapes do not fit it."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".experts") or leaf not in FUSED_EXPERTS or len(shape) != 3:
        return None
    for pieces in FUSED_EXPERTS[leaf]:
        rows = [tuple(f"{prefix}.{e}.{piece}.weight" for piece in pieces) for e in range(shape[0])]
        if all(n in files for row in rows for n in row) and all(
                [files[n][0][1:] for n in row] == [shape[2:]] * len(row)
                and sum(files[n][0][0] for n in row) == shape[1] for row in rows):
            return rows
    return None


def missing_from_files(model: torch.nn.Module, model_path: str) -> str | None:
    """Why `materialize` could not load `model` from `model_path`'s files (None: it can)."""
    files = file_shapes(model_path)
    if not files:
        return f"no safetensors files in {model_path}"
    for name, p in model.named_parameters():
        if name not in files and expert_pieces(name, tuple(p.shape), files) is None:
            return f"parameter {name} is not a tensor of {model_path}'s files"
        if name in files and files[name][0] != tuple(p.shape):
            return f"parameter {name} has shape {tuple(p.shape)}, the files {files[name][0]}"
    return None


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """(first row, rows) of the full tensor that this rank holds of `param`: all of a plain
    tensor; a DTensor sharded on dim 0 over a 1-D mesh holds torch.chunk's piece (what FSDP2
    lays out: ceil(rows / ranks) each, the last ones shorter or empty)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 0
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"expected a parameter sharded on dim 0 over one mesh dimension, got {param.placements}")
    rows, ranks = param.shape[0], param.device_mesh.size()
    per_rank = -(-rows // ranks)
    start = min(param.device_mesh.get_local_rank() * per_rank, rows)
    count = min(rows, start + per_rank) - start
    if param.to_local().shape[0] != count:
        raise RuntimeError(f"shard layout changed: expected {count} rows at {start}, holding {param.to_local().shape}")
    return start, count


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device, fill) -> None:
    """Give `model`'s meta parameters storage on `device` (its buffers kept), then `fill(name,
    local, param)` copies each one's local rows in (`local`: the plain tensor this rank owns)."""
    from torch.distributed.tensor import DTensor

    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    for name, p in model.named_parameters():
        fill(name, p.to_local() if isinstance(p, DTensor) else p, p)


def load_own_rows(model: torch.nn.Module, model_path: str, device: torch.device) -> None:
    """`materialize` from the checkpoint's files: each parameter's own rows, read alone."""
    from safetensors import safe_open

    where = file_shapes(model_path)
    with ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in weight_files(model_path)}

        def read(name, local, param):
            start, count = shard_rows(param)
            if name not in where:  # fused experts: this rank's experts, each stacked from its own files
                rows = expert_pieces(name, tuple(param.shape), where)
                for row, e in zip(local, range(start, start + count)):
                    row.copy_(torch.cat([handles[where[n][1]].get_tensor(n) for n in rows[e]]))
                return
            part = handles[where[name][1]].get_slice(name)
            local.copy_(part[start:start + count] if param.dim() else part[:])

        materialize(model, device, read)
