"""Routing rows of routing replay (algo.moe_routing: replay), kept in numpy: what a MoE engine
routed each position of a request to, uint8 [positions, MoE layers, top-k], and how the rows of
a request's parts (the engine's steps, an aborted request and its resumption) make one sample's.

A position keeps the last rows recorded for it. A request aborted by an in-flight update resumes as
a new request that prefills its prefix again under the new weights, and every token sampled after
that attended to the prefix as recomputed: its last routing is what those tokens, the run's fresh
ones, were produced through. (Keeping the first instead made the fresh tokens' trainer/engine
log-ratio of the tiny MoE 0.01-0.55 nats on about a tenth of the steps, against 1e-4 without
replay.) The tokens sampled before the abort are a version stale by then, and are replayed through
the newer routing of their prefix. A position with none is NONE in every slot, and the learner
routes it itself.

On the engine, `RoutingCapture` files each forward's rows under their requests. vLLM 0.32 returns
routed experts only from its Model Runner V2, which needs Triton, so not on CPU; its routers do
call a capture hook with each forward's top-k ids (`BaseRouter.capture_fn`), and the model
runner's `_prepare_inputs` fixes the batch order (each request's scheduled tokens, from its
computed-token count on). asyncrl's worker extension (sync/vllm_gloo_engine.py `WorkerExtension`)
binds the two to a `RoutingCapture`. A step's rows are filed when the next step starts (or when
they are taken), so each request collects the rows of the positions it computed. A prompt served
from the prefix cache was computed by an earlier request sharing its first blocks (a GRPO group's
other samples, a common system prompt): the rows of that request's prefill are kept per block,
keyed as the cache keys its blocks, until a load resets the cache.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

NONE = 255
"""A position with no recorded routing (expert ids are 0..254: uint8)."""


def merged(segments: list[tuple[int, np.ndarray]], num_layers: int, top_k: int) -> np.ndarray:
    """[positions, layers, k] from (first position, rows) segments in the order they were computed;
    a position computed twice keeps its last rows; a gap is NONE."""
    length = max((first + len(rows) for first, rows in segments), default=0)
    out = np.full((length, num_layers, top_k), NONE, dtype=np.uint8)
    for first, rows in segments:  # later segments written over earlier ones: the last one wins
        out[first:first + len(rows)] = rows
    return out


def sample_routes(parts: list[np.ndarray | None], positions: int) -> bytes:
    """A sample's routing bytes over its `positions` (prompt + response) from its requests' rows
    in order (each request's rows start at position 0: a resumed request re-feeds the prefix);
    b"" when no part recorded any."""
    parts = [p for p in parts if p is not None and p.size]
    if not parts:
        return b""
    layers, top_k = parts[0].shape[1:]
    rows = merged([(0, p) for p in parts], layers, top_k)[:positions]
    if len(rows) < positions:
        rows = np.concatenate([rows, np.full((positions - len(rows), layers, top_k), NONE, dtype=np.uint8)])
    return rows.tobytes()


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


class RoutingCapture:
    """The rows of one engine worker's forwards, filed per request (the worker side of routing
    replay; sync/vllm_gloo_engine.py's `WorkerExtension` feeds it from vLLM's hooks)."""

    def __init__(self, num_layers: int, top_k: int, block_size: int):
        self.num_layers, self.top_k, self.block_size = num_layers, top_k, block_size
        self.layout: list[tuple[str, int, int]] | None = None  # (request, first position, tokens)
        self.rows: np.ndarray | None = None  # this step's [tokens, layers, k]
        self.pending: dict = {}  # this step's top-k ids per layer, on the engine's device
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
        import torch

        self.pending[layer] = topk_ids[:n].to(dtype=torch.uint8, copy=True)

    def file_step(self) -> None:
        if self.rows is None:
            return
        if self.pending:
            import torch

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
