"""Rollout routing replay's learner half (algo.moe_routing: replay): every forward of the policy
(and of the reference) routes each position to the experts the engine routed it to when it
generated the sample, so the learner's pi_theta is computed through the same experts as the
behaviour policy's logprobs (R3, "Stabilizing MoE RL by aligning training and inference routers",
arXiv 2510.11370).

The router still runs: its logits feed the auxiliary losses, and the replayed experts' gate
weights are its probabilities at them (algo/moe.py `replayed_routing`), so the router keeps
learning; only the choice is forced. A position the engine recorded nothing for (the response's
last token, which no engine forward took as input; a multi-turn episode, whose turns' routing is
not collected) keeps the router's own choice.

Hugging Face's top-k routers (`Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`, ...) take a layer's
hidden states flattened to [B * L, H] and return (logits, weights, indices); `install` wraps each
one's forward, found by name (`model.layers.<i>.mlp.gate`, the layer index the engine's rows use).
The rows for a micro-batch are set by `policy_forward` before its forward and stay set until the
next one, so activation checkpointing's recompute in the backward sees the same choice.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch

from asyncrl.algo.moe import replayed_routing, same_experts
from asyncrl.learner.routers import routers

NONE = 255  # rollout/routes.py: a position with no recorded routing
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


ROUTE_COUNTS = ("recorded", "used_agree", "own_agree", "pairs")
"""What `Replay.read` sums over (position, layer) pairs of one forward: with a recorded routing;
routed as recorded (all of them under replay); whose router's own top-k is the recorded one; all
real (not padding) pairs."""


@dataclass
class Replay:
    """The rows of the micro-batch being computed, shared by the wrapped routers."""

    rows: torch.Tensor | None = None  # [N, layers * k] int64, -1 where none; None: routers route freely
    positions: torch.Tensor | None = None  # [N] bool: real positions (not padding)
    counts: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, the last forward's (on device)

    def use(self, routes: torch.Tensor | None, real: torch.Tensor | None = None) -> None:
        """`routes` [N, row] uint8 (collate.py), or None; `real` [N] the positions that are not padding."""
        if routes is None:
            self.rows, self.positions = None, None
        else:
            rows = routes.long()
            self.rows = torch.where(rows == NONE, -1, rows)
            self.positions = real.bool() if real is not None else torch.ones(len(rows), dtype=torch.bool,
                                                                                 device=rows.device)
        self.counts = {}

    def read(self) -> torch.Tensor | None:
        """[4] float64 on the device, the ROUTE_COUNTS of the last forward summed over its layers;
        None when it replayed nothing."""
        if not self.counts:
            return None
        return torch.stack(list(self.counts.values())).sum(0).double()


def install(model: torch.nn.Module) -> Replay:
    """Wrap every top-k router of `model` to replay recorded routing; the `Replay` they share."""
    replay, found = Replay(), set(map(id, routers(model)))
    wrapped = 0
    for name, module in model.named_modules():
        if id(module) not in found:
            continue
        match = _LAYER.search(name)
        if match is None or not hasattr(module, "top_k"):
            raise ValueError(f"routing replay: cannot tell the layer or top-k of router {name!r} "
                             f"({type(module).__name__}); it supports Hugging Face's top-k routers")
        module.forward = functools.partial(_replaying_forward, replay, int(match.group(1)),
                                           bool(getattr(module, "norm_topk_prob", True)), module.forward)
        wrapped += 1
    if not wrapped:
        raise ValueError("algo.moe_routing: replay needs a mixture-of-experts model; this one has no router")
    model._asyncrl_replay = replay
    return replay


def replay_of(model: torch.nn.Module) -> Replay | None:
    """The model's `Replay` (through a wrapper that keeps the model as `.module`: DeepSpeed's engine)."""
    found = getattr(model, "_asyncrl_replay", None)
    inner = getattr(model, "module", None)
    return found if found is not None or not isinstance(inner, torch.nn.Module) else replay_of(inner)


def _replaying_forward(replay: Replay, layer: int, norm_topk_prob: bool, forward, hidden_states, *args, **kwargs):
    out = forward(hidden_states, *args, **kwargs)
    if replay.rows is None:
        return out
    if not (isinstance(out, tuple) and len(out) == 3):
        raise TypeError("routing replay: a router must return (logits, weights, indices)")
    logits, _, own = out
    rows, k = replay.rows, own.shape[-1]
    if rows.shape[0] != logits.shape[0] or rows.shape[1] % k or layer >= rows.shape[1] // k:
        raise ValueError(f"routing replay: rows of shape {tuple(rows.shape)} for a router of layer {layer} "
                         f"with {logits.shape[0]} positions and top-{k}")
    recorded = rows.view(rows.shape[0], -1, k)[:, layer].to(own.device)
    weights, indices = replayed_routing(logits, own, recorded, norm_topk_prob)
    with torch.no_grad():  # kept on the device: read once per forward, not once per layer
        real = replay.positions.to(own.device)
        has = (recorded >= 0).all(dim=-1) & real
        replay.counts[layer] = torch.stack([has.sum(), (same_experts(indices, recorded) & has).sum(),
                                            (same_experts(own, recorded) & has).sum(), real.sum()])
    return logits, weights, indices
