"""Routing rows of routing replay (algo.moe_routing: replay), as plain numpy: what a MoE engine
routed each position of a request to, uint8 [positions, MoE layers, top-k], and how the rows of
a request's parts (the engine's steps, an aborted request and its resumption) make one sample's.

A position keeps the last rows recorded for it. A request aborted by an in-flight update resumes as
a new request that prefills its prefix again under the new weights, and every token sampled after
that attended to the prefix as recomputed: its last routing is what those tokens, the run's fresh
ones, were produced through. (Keeping the first instead made the fresh tokens' trainer/engine
log-ratio of the tiny MoE 0.01-0.4 nats on about a tenth of the steps, against 1e-4 without
replay.) The tokens sampled before the abort are a version stale by then, and are replayed through
the newer routing of their prefix. A position with none is NONE in every slot, and the learner
routes it itself.
"""

from __future__ import annotations

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
