"""Low-rank adapters on the learner's policy (`learner.lora`), with peft.

Each targeted linear layer computes W x + (alpha / r) B A x: W frozen (held in the engines' dtype,
no float32 master copy), A [r, in] and B [out, r] trained, B starting at zero so that version 0 is
the base model the engines start from. The optimizer holds the adapter alone, and a push carries
only the adapter's tensors, under the names peft saves them by (what vLLM's LoRA loader reads):
the engines serve the base plus the adapter (`rollout/vllm_engine.py`), never merged weights.

peft rather than a LoRA layer of our own: its layers already work under FSDP2 and DeepSpeed, its
`disable_adapter` gives the KL term's reference (the base) with no second model, and its files
(adapter_config.json + adapter_model.safetensors) are what vLLM, transformers and the hub load.

An adapter directory is also a model path: the learner and the engines given one load its base
(`base_model_name_or_path`) and the adapter on it, which is how a run resumes from a checkpoint and
how `asyncrl evaluate` reads a LoRA run's final policy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # peft's name for a model's one adapter; it sits in the runtime names only


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> str:
    """The base model an adapter directory was trained on."""
    base = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{path}/{ADAPTER_CONFIG} names no base_model_name_or_path: the base it adapts is unknown")
    return base


def linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_targets(model: torch.nn.Module, cfg) -> list[str]:
    """The linear layers `cfg` (LoraConfig) adapts; ConfigError naming the field when a target
    matches none of the model's linear layers or the rank exceeds a targeted layer's size."""
    linears = linear_layers(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if cfg.target_modules == "all-linear":
        chosen = [n for n, m in linears.items() if m is not head]
    else:
        chosen = []
        for target in cfg.target_modules:
            hits = [n for n in linears if n == target or n.endswith("." + target)]
            if not hits:
                suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
                raise ConfigError(f"learner.lora.target_modules: {target!r} names no linear layer of "
                                  f"{type(model).__name__} (it has {', '.join(suffixes)})")
            chosen += hits
    if head is not None and any(linears[name] is head for name in chosen):
        raise ConfigError("learner.lora.target_modules: the LM head cannot take an adapter (vLLM serves adapters "
                          "on the decoder's linear layers only); name those, or use all-linear")
    if not chosen:
        raise ConfigError(f"learner.lora.target_modules: {type(model).__name__} has no linear layer to adapt")
    for name in chosen:
        layer = linears[name]
        if cfg.rank > min(layer.in_features, layer.out_features):
            raise ConfigError(f"learner.lora.rank={cfg.rank} is larger than {name} "
                              f"({layer.out_features}x{layer.in_features}) allows: at most "
                              f"{min(layer.in_features, layer.out_features)}")
    return chosen


def apply_lora(model: torch.nn.Module, cfg, adapter_dir: str | Path | None = None) -> torch.nn.Module:
    """`model` with adapters on the layers `cfg` targets (its own weights frozen), their weights
    read from `adapter_dir` when given (a checkpoint's, or a run's final policy)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_targets(model, cfg)
    targets = cfg.target_modules if cfg.target_modules == "all-linear" else list(cfg.target_modules)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                              bias="none", task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, peft_cfg)  # peft keeps adapters in float32 over a bf16/fp16 base
    if adapter_dir is not None:
        load_adapter_weights(wrapped, adapter_dir)
    return wrapped


def load_adapter_weights(model: torch.nn.Module, adapter_dir: str | Path) -> None:
    """Copy an adapter directory's tensors into `model`'s adapter; ConfigError when they are not
    this model's (another base, rank or set of targets)."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    own = {wire_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    wrong = [n for n in own if n in saved and tuple(saved[n].shape) != tuple(own[n].shape)]
    if missing or extra or wrong:
        what = (f"missing {missing[:2]}" if missing else f"unknown {extra[:2]}" if extra else
                f"{wrong[0]} is {tuple(saved[wrong[0]].shape)}, the model's {tuple(own[wrong[0]].shape)}")
        raise ConfigError(f"the adapter in {adapter_dir} does not fit this model and learner.lora ({what}): "
                          f"it was trained on another base, rank or target_modules")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(saved[name])


def wire_name(name: str) -> str:
    """A runtime adapter parameter's name as peft saves it (and vLLM loads it): without the
    adapter's name, e.g. ...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def adapter_config(model: torch.nn.Module, base: str) -> dict[str, Any]:
    """adapter_config.json's contents: peft's config of `model`'s adapter with the resolved target
    modules and `base` as the base model's path."""
    cfg = model.peft_config[ADAPTER_NAME].to_dict()
    cfg = {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}
    cfg["base_model_name_or_path"] = base
    return json.loads(json.dumps(cfg, default=str))


def write_adapter(out: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]) -> Path:
    """An adapter directory in peft's format: `tensors` (wire names) and `config`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.detach().cpu().contiguous() for name, t in tensors}
    tmp = out / f".{ADAPTER_WEIGHTS}.tmp"  # a reader (the engine) never sees half a file
    save_file(weights, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out


def adapter_off(model: torch.nn.Module):
    """The base model's forward (the adapter bypassed): the KL term's reference."""
    return model.disable_adapter() if is_lora(model) else nullcontext()


@contextmanager
def adapter_swapped(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Forward with these adapter tensors (this rank's shards, by runtime name) in place of the
    trained ones, restored after: a reference that was reset to an adapter of the run."""
    params = {n: p for n, p in model.named_parameters() if n in tensors}
    with torch.no_grad():
        kept = {n: _local(p).clone() for n, p in params.items()}
        for n, p in params.items():
            _local(p).copy_(tensors[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                _local(p).copy_(kept[n])


def merge_stream(named_params: Iterable[tuple[str, torch.Tensor]], cfg) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA policy's full parameters (runtime names, as a backend gathers them one at a time) as
    the base model's, the adapter merged in: W + (alpha / r) B A under W's own name. peft registers
    a wrapped layer's base before its A and B, so a base weight is held only until they follow."""
    scaling = cfg.alpha / cfg.rank
    held: dict[str, torch.Tensor] = {}  # layer -> its base weight, waiting for A and B
    lora_a: dict[str, torch.Tensor] = {}
    for name, tensor in named_params:
        if ".base_layer.weight" in name:
            held[name.split(".base_layer.")[0]] = tensor
        elif ".lora_A." in name:
            lora_a[name.split(".lora_A.")[0]] = tensor
        elif ".lora_B." in name:
            layer = name.split(".lora_B.")[0]
            w, a = held.pop(layer), lora_a.pop(layer)
            merged = w.double() + scaling * (tensor.double() @ a.double())
            yield _base_name(layer + ".weight"), merged.to(w.dtype)
        else:
            yield _base_name(name), tensor
    if held or lora_a:
        raise RuntimeError(f"adapted layers without their adapter: {sorted(held or lora_a)[:3]}")


def _base_name(name: str) -> str:
    """A peft runtime name as the base model's own: base_model.model.X -> X, X.base_layer.bias -> X.bias."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
