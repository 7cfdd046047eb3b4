"""One micro-batch through a Hugging Face causal LM, down to per-loss-token logprobs and entropies.

The model is asked for its final hidden states (and only the last position's logits, which is
nearly free), the loss positions' hidden rows are gathered, and the LM head is applied in chunks
under activation checkpointing (`token_logprobs_and_entropy_from_hidden`), so no [B, L, V] or
[T, V] logits tensor is ever held, forward or backward. On a MoE model the router logits come
back too, for the auxiliary losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.algo.token_stats import token_logprobs_and_entropy_from_hidden
from asyncrl.learner.collate import MicroBatch


@dataclass
class TokenForward:
    logprobs: torch.Tensor   # [T] log pi(a_t) at the token's sampling temperature
    entropy: torch.Tensor    # [T] H_t over the vocabulary
    router_logits: tuple[torch.Tensor, ...] | None = None  # per MoE layer [B * L, E]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0))


def policy_forward(model: torch.nn.Module, mb: MicroBatch, chunk: int, device: torch.device,
                   moe: bool | None = None) -> TokenForward:
    """Logprobs and entropies of mb's loss tokens; differentiable when grad is enabled. `moe`:
    whether to ask for router logits (None: `is_moe(model)`; a wrapped model, e.g. a DeepSpeed
    engine, has a `config` of its own, so its learner says)."""
    kwargs = {"output_router_logits": True} if (is_moe(model) if moe is None else moe) else {}
    out = model(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                output_hidden_states=True, logits_to_keep=1, **kwargs)
    hidden = out.hidden_states[-1][mb.rows.to(device), mb.cols.to(device)]  # [T, H], after the final norm
    token_head = getattr(model, "token_head", None) or TokenHead(model.get_output_embeddings())
    logp, entropy = token_head(hidden, mb.targets.to(device), mb.temperatures.to(device), chunk)
    return TokenForward(logp, entropy, getattr(out, "router_logits", None) if kwargs else None)


class TokenHead(torch.nn.Module):
    """The LM head applied to the loss positions' hidden rows, in chunks. A module of its own so
    that a backend which gathers parameters only inside a module's forward (DeepSpeed ZeRO-3) can
    be told that this forward uses the head's weight (`register_external_parameter`); the head
    is referenced, not registered as a child, so parameter names do not change."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.__dict__["head"] = head  # not a submodule

    def forward(self, hidden, targets, temperatures, chunk: int):
        return token_logprobs_and_entropy_from_hidden(hidden, self.head.weight, targets, temperatures, chunk,
                                                      getattr(self.head, "bias", None))
