"""Rollout routing replay's engine half (algo.moe.routing: replay): which experts a vLLM engine
routed each token of a request to, per MoE layer, for the learner to replay (learner/replay.py).

vLLM 0.32 returns routed experts only from its Model Runner V2, which needs Triton, so not on
CPU. Its routers do call a capture hook with each forward's top-k ids (`BaseRouter.capture_fn`),
so this worker extension binds its own: a forward's rows are in the model runner's batch order,
which `_prepare_inputs` fixes (each request's scheduled tokens, from its computed-token count on),
and wrapping that call gives the step's layout. A step's rows are filed under their requests
when the next step starts (or when they are taken), so each request collects the rows of the
positions it computed, at the weights that computed them.

- A position keeps the last routing recorded for it (rollout/routes.py says why): a request
  preempted and recomputed takes the routing its later tokens attended through.
- A prompt served from the prefix cache was computed by an earlier request sharing its first
  blocks (a GRPO group's other samples, a common system prompt): the rows of that request's
  prefill are kept per block, keyed as the cache keys its blocks, until a load resets the cache.
- A position with no routing (the last sampled token, which no forward takes as input; a cached
  prefix of another prompt) is row 255 in every slot: the learner routes it itself.

`RoutingWorkerExtension` is passed as vLLM's `worker_extension_cls`; its methods join the
worker's and are called through `collective_rpc`. It subclasses the gloo receiver's extension, so
one class serves both.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from functools import partial

import numpy as np
import torch

from asyncrl.rollout.routes import NONE, merged
from asyncrl.sync.vllm_gloo_engine import GlooEngineRegistration

KEEP_FINISHED_S = 120.0  # a finished request's rows wait this long for the actor to take them
PREFIXES_KEPT = 1 << 14  # cached-prefix blocks whose prefill rows are kept (for prefix-cache hits)


def block_keys(tokens: np.ndarray, block_size: int, upto: int) -> list[int]:
    """A chained key per whole block of tokens[:upto] (as vLLM's prefix cache keys its blocks): the
    i-th is the same for two sequences exactly when their first (i + 1) blocks are."""
    keys, key = [], 0
    for end in range(block_size, upto + 1, block_size):
        key = hash((key, tokens[end - block_size:end].tobytes()))
        keys.append(key)
    return keys


class _Capture:
    """The rows of one worker's forwards, filed per request."""

    def __init__(self, num_layers: int, top_k: int, block_size: int):
        self.num_layers, self.top_k, self.block_size = num_layers, top_k, block_size
        self.layout: list[tuple[str, int, int]] | None = None  # (request, first position, tokens)
        self.rows: np.ndarray | None = None  # this step's [tokens, layers, k]
        self.pending: dict[int, torch.Tensor] = {}  # this step's top-k ids per layer, on the engine's device
        self.segments: dict[str, list[tuple[int, np.ndarray]]] = {}
        self.finished: dict[str, float] = {}
        self.prefixes: OrderedDict[int, np.ndarray] = OrderedDict()  # block key -> rows up to that block's end
        self.prompt_of: dict[str, np.ndarray] = {}  # requests whose prefill starts at 0: their prompt tokens

    def start_step(self, scheduler_output, req_ids: list[str], computed: np.ndarray, scheduled: np.ndarray) -> None:
        self.file_step()
        now = time.monotonic()
        for rid in scheduler_output.finished_req_ids:
            self.finished.setdefault(rid, now)
        for rid in [r for r, t in self.finished.items() if now - t > KEEP_FINISHED_S]:
            self._forget(rid)
        for new in scheduler_output.scheduled_new_reqs:
            tokens = np.asarray(new.prompt_token_ids or [], dtype=np.int64)
            cached = new.num_computed_tokens
            keys = block_keys(tokens, self.block_size, cached) if cached else []
            if keys and keys[-1] in self.prefixes:  # served from the cache: the rows of the prefill that made it
                self.segments.setdefault(new.req_id, []).append((0, self.prefixes[keys[-1]][:cached]))
            if not cached:
                self.prompt_of[new.req_id] = tokens
        self.pending = {}
        self.layout = [(rid, int(c), int(n)) for rid, c, n in zip(req_ids, computed, scheduled)]
        self.rows = np.full((int(scheduled.sum()), self.num_layers, self.top_k), NONE, dtype=np.uint8)

    def capture(self, layer: int, topk_ids) -> None:
        if self.rows is None or not 0 <= layer < self.num_layers:
            return
        n = self.rows.shape[0]
        if topk_ids.shape[0] < n:  # not this step's forward (a warm-up or dummy run)
            return
        # kept where it was computed: one copy to the host a step (file_step), not one a layer
        self.pending[layer] = topk_ids[:n].to(dtype=torch.uint8, copy=True)

    def file_step(self) -> None:
        if self.rows is None:
            return
        if self.pending:
            layers = sorted(self.pending)
            self.rows[:, layers] = torch.stack([self.pending[i] for i in layers], dim=1).cpu().numpy()
            self.pending = {}
        at = 0
        for rid, first, n in self.layout:
            rows = self.rows[at:at + n]
            self.segments.setdefault(rid, []).append((first, rows))
            tokens = self.prompt_of.pop(rid, None)
            if tokens is not None and first == 0:  # its prefill: the rows of every whole block it computed
                kept = rows[:min(n, len(tokens))].copy()
                for key in block_keys(tokens, self.block_size, len(kept)):
                    self.prefixes[key] = kept
                    self.prefixes.move_to_end(key)
                while len(self.prefixes) > PREFIXES_KEPT:
                    self.prefixes.popitem(last=False)
            at += n
        self.layout, self.rows = None, None

    def take(self, external_ids: list[str]) -> dict[str, bytes]:
        """Each named request's rows [positions, layers, k] as bytes (b"" for one never seen),
        forgotten once taken; vLLM names a request by the caller's id plus "-" and 8 characters."""
        self.file_step()
        wanted = set(external_ids)
        internal = {rid.rsplit("-", 1)[0]: rid for rid in self.segments if rid.rsplit("-", 1)[0] in wanted}
        out = {}
        for ext in external_ids:
            rid = internal.get(ext)
            out[ext] = merged(self.segments[rid], self.num_layers, self.top_k).tobytes() if rid else b""
            if rid:
                self._forget(rid)
        return out

    def forget_prefixes(self) -> None:
        self.prefixes.clear()

    def _forget(self, rid: str) -> None:
        self.segments.pop(rid, None)
        self.finished.pop(rid, None)
        self.prompt_of.pop(rid, None)


class RoutingWorkerExtension(GlooEngineRegistration):
    """vLLM `worker_extension_cls` of an engine that records routing (and receives gloo pushes)."""

    def asyncrl_routing_start(self) -> tuple[int, int]:
        """Bind the capture to every MoE router of this worker's model; returns (layers, k)."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = self.model_runner
        config = runner.vllm_config.model_config
        num_layers, top_k = config.get_total_num_hidden_layers(), config.get_num_experts_per_tok()
        if config.get_num_experts() > NONE:
            raise ValueError(f"routing replay records expert ids as uint8: {config.get_num_experts()} experts "
                             f"is more than {NONE}")
        capture = _Capture(num_layers, top_k, runner.vllm_config.cache_config.block_size)
        bound = 0
        for module in runner.get_model().modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                module.router.set_capture_fn(partial(capture.capture, module.layer_id))
                bound += 1
        if not bound:
            raise ValueError("routing replay: the engine's model has no MoE router it can record")
        prepare = runner._prepare_inputs

        def prepare_and_record(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            batch = runner.input_batch
            n = batch.num_reqs
            capture.start_step(scheduler_output, list(batch.req_ids[:n]),
                               batch.num_computed_tokens_cpu[:n].copy(), np.asarray(num_scheduled_tokens[:n]))
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        runner._prepare_inputs = prepare_and_record
        self._asyncrl_routing = capture
        return num_layers, top_k

    def asyncrl_routing_take(self, request_ids: list[str]) -> dict[str, bytes]:
        return self._asyncrl_routing.take(request_ids)

    def asyncrl_routing_forget_prefixes(self) -> None:
        """After a weight load: prompt prefills of the old weights are no longer what the cache holds."""
        self._asyncrl_routing.forget_prefixes()
