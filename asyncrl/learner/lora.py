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
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
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


def embedding_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The input embedding and the LM head, by module name: adapters there only when named in
    target_modules (peft's all-linear leaves the head out too) and when the engine serves them."""
    wanted = [getattr(model, f)() for f in ("get_input_embeddings", "get_output_embeddings") if hasattr(model, f)]
    return {name: m for name, m in model.named_modules() if any(m is w for w in wanted if w is not None)}


def check_targets(model: torch.nn.Module, cfg,
                  served_embeddings: Callable[[], Collection[str]] | None = None) -> list[str]:
    """The layers `cfg` (LoraConfig) adapts; ConfigError naming the field when a target matches
    none of the model's linear or embedding layers, the rank exceeds a targeted layer's size, or
    an embedding layer is targeted that the engines serve no adapter on (`served_embeddings()`:
    the module-name suffixes they do, e.g. vLLM's Llama class: embed_tokens and lm_head, asked
    only when an embedding layer is targeted; None: not checked, as on the learner, where
    preflight has checked it)."""
    linears, embeddings = linear_layers(model), embedding_layers(model)
    layers = {**linears, **embeddings}
    if cfg.target_modules == "all-linear":
        chosen = [n for n in linears if n not in embeddings]
    else:
        chosen = []
        for target in cfg.target_modules:
            hits = [n for n in layers if n == target or n.endswith("." + target)]
            if not hits:
                suffixes = sorted({n.rsplit(".", 1)[-1] for n in layers})
                raise ConfigError(f"learner.lora.target_modules: {target!r} names no linear or embedding layer of "
                                  f"{type(model).__name__} (it has {', '.join(suffixes)})")
            chosen += hits
    if not chosen:
        raise ConfigError(f"learner.lora.target_modules: {type(model).__name__} has no linear layer to adapt")
    served = served_embeddings() if served_embeddings is not None and any(n in embeddings for n in chosen) else None
    for name in (n for n in chosen if n in embeddings):
        suffix = name.rsplit(".", 1)[-1]
        if served is not None and suffix not in served:
            raise ConfigError(f"learner.lora.target_modules: {suffix} cannot take an adapter on {type(model).__name__}: "
                              f"the engines serve adapters on its decoder's linear layers only (vLLM's class for it "
                              f"declares no embedding_modules); name those, or use all-linear")
        if cfg.dropout and embeddings[name] is model.get_output_embeddings():
            raise ConfigError("learner.lora.dropout must be 0 with an adapter on the LM head (the learner applies the "
                              "head's adapter as W + (alpha / r) B A, as the engines do, with no dropout)")
    for name in chosen:
        weight = layers[name].weight
        if cfg.rank > min(weight.shape):
            raise ConfigError(f"learner.lora.rank={cfg.rank} is larger than {name} "
                              f"({weight.shape[0]}x{weight.shape[1]}) allows: at most {min(weight.shape)}")
    return chosen


def adapted_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight with its adapter in, W + (alpha / r) B A (differentiable in A and
    B, in the adapter's dtype), or its own weight when it has no active adapter (none, or the
    adapter switched off for the KL reference). For the LM head, which the learner applies to the
    loss positions itself (model_forward.TokenHead) rather than through the layer's forward: this
    holds one more [vocab, hidden] tensor while the head runs."""
    base = getattr(layer, "base_layer", None)
    if base is None or layer.disable_adapters or ADAPTER_NAME not in layer.active_adapters:
        return layer.weight
    a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
    return base.weight.to(a.dtype) + layer.scaling[ADAPTER_NAME] * (b @ a)


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
    adapter's name, e.g. ...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight and an
    embedding's ...embed_tokens.lora_embedding_A.default -> ...embed_tokens.lora_embedding_A."""
    return name.replace(f".{ADAPTER_NAME}.", ".").removesuffix(f".{ADAPTER_NAME}")


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


@contextmanager
def adapter_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model's forward (the adapter bypassed): the KL term's reference. peft switches the
    adapter's requires_grad off and on again with it; under FSDP2 the parameters of the root's
    group (an embedding's or LM head's adapter) did not come back on, and dropped out of the
    pushes and the optimizer from the first step on, so their flags are restored here."""
    if not is_lora(model):
        yield
        return
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        with model.disable_adapter():
            yield
    finally:
        for p in trainable:
            p.requires_grad_(True)


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


def merge_stream(named_params: Iterable[tuple[str, torch.Tensor]], cfg,
                 tied: tuple[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA policy's full parameters (runtime names, as a backend gathers them one at a time) as
    the base model's, the adapter merged in under each adapted layer's own name: a linear layer's
    W + (alpha / r) B A, an embedding's E + (alpha / r) (B A)^T. peft registers a wrapped layer's
    base before its A and B, so a base weight is held only until they follow.

    `tied` (`untied_head`): the base ties its LM head to its embedding and an adapter sits on one
    of them, so the merged model's two differ. The shared weight is listed once, under the first
    of the two names; the head gets its own copy under the second, merged with its adapter if it
    has one (the merged config unties them)."""
    scaling = cfg.alpha / cfg.rank
    held: dict[str, torch.Tensor] = {}  # layer -> its base weight, waiting for A and B
    lora_a: dict[str, torch.Tensor] = {}
    shared, head_done = None, False
    for name, tensor in named_params:
        if tied is not None and name == tied[0]:
            shared = tensor
        if ".base_layer.weight" in name:
            held[name.split(".base_layer.")[0]] = tensor
        elif ".lora_A." in name or ".lora_embedding_A." in name:
            lora_a[name.split(".lora_")[0]] = tensor
        elif ".lora_B." in name or ".lora_embedding_B." in name:
            layer = name.split(".lora_")[0]
            w = held.pop(layer) if layer in held else shared
            if w is None:
                raise RuntimeError(f"{layer} has an adapter and no base weight in the stream")
            delta = tensor.double() @ lora_a.pop(layer).double()
            merged = w.double() + scaling * (delta.T if ".lora_embedding_B." in name else delta)
            head_done |= tied is not None and _base_name(layer + ".weight") == tied[1]
            yield _base_name(layer + ".weight"), merged.to(w.dtype)
        else:
            yield _base_name(name), tensor
    if held or lora_a:
        raise RuntimeError(f"adapted layers without their adapter: {sorted(held or lora_a)[:3]}")
    if tied is not None and not head_done:  # an adapted embedding: the head keeps the base's weight
        yield tied[1], shared


def untied_head(model: torch.nn.Module) -> tuple[str, str] | None:
    """For merge_stream: when `model`'s base ties its LM head to its embedding and either has an
    adapter, the name the shared weight goes by in `model.named_parameters()` (a deduplicated
    listing keeps the first) and the head weight's name in the merged model; else None."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if not (getattr(model.config, "tie_word_embeddings", False)
            and any(getattr(m, "base_layer", None) is not None for m in (head, embedding))):
        return None
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight]
    head_name = next(n for n, m in model.named_modules() if m is head)
    return names[0], _base_name(head_name + ".weight")


def _base_name(name: str) -> str:
    """A peft runtime name as the base model's own: base_model.model.X -> X, X.base_layer.bias -> X.bias."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
