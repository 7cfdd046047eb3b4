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
from asyncrl.learner.lora import adapted_weight
from asyncrl.learner.phases import phase
from asyncrl.learner.replay import replay_of


@dataclass
class TokenForward:
    logprobs: torch.Tensor   # [T] log pi(a_t) at the token's sampling temperature
    entropy: torch.Tensor    # [T] H_t over the vocabulary
    router_logits: tuple[torch.Tensor, ...] | None = None  # per MoE layer [B * L, E]
    routes: torch.Tensor | None = None  # routing replay's ROUTE_COUNTS of this forward (replay.py)


def is_moe(model: torch.nn.Module) -> bool:
    return bool(getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0))


def policy_forward(model: torch.nn.Module, mb: MicroBatch, chunk: int, device: torch.device,
                   moe: bool | None = None, recompute_head: bool = True, head_fp32: bool = False) -> TokenForward:
    """Logprobs and entropies of mb's loss tokens; differentiable when grad is enabled. `moe`:
    whether to ask for router logits (None: `is_moe(model)`; a wrapped model, e.g. a DeepSpeed
    engine, has a `config` of its own, so its learner says). `recompute_head` and `head_fp32`:
    learner.recompute_head and learner.head_dtype (TokenHead)."""
    kwargs = {"output_router_logits": True} if (is_moe(model) if moe is None else moe) else {}
    replay = replay_of(model)
    if replay is not None:  # this micro-batch's recorded experts, until the next forward (recompute)
        routes = mb.routed_experts
        replay.use(None if routes is None else routes.to(device), mb.attention_mask.reshape(-1).to(device))
    with phase("forward"):
        out = model(**mb.model_inputs(device), output_hidden_states=True, logits_to_keep=1, **kwargs)
        hidden = out.hidden_states[-1][mb.rows.to(device), mb.cols.to(device)]  # [T, H], after the final norm
    token_head = getattr(model, "token_head", None) or TokenHead(model.get_output_embeddings())
    with phase("head"):
        logp, entropy = token_head(hidden, mb.targets.to(device), mb.temperatures.to(device), chunk,
                                   recompute=recompute_head, fp32=head_fp32)
    return TokenForward(logp, entropy, getattr(out, "router_logits", None) if kwargs else None,
                        replay.read() if replay is not None else None)


@torch.no_grad()
def packing_is_exact(model: torch.nn.Module, device: torch.device, tolerance: float = 1e-3) -> bool:
    """Whether the model keeps attention within packed sequences (collate.py): two sequences of
    different lengths scored packed and padded must agree. Hugging Face's attention reads
    restarting position ids as packed sequences; a model with attention code of its own may not,
    and would then let each sequence attend to the one before it (differences of order 0.1)."""
    from asyncrl.learner.collate import collate
    from asyncrl.types import SequenceChunk

    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    chunks = [SequenceChunk(f"probe{i}", 0, torch.randint(1, vocab, (3,), generator=g).tolist(),
                            torch.randint(1, vocab, (n,), generator=g).tolist(), 0, [0.0] * n, [0] * n, 0.0)
              for i, n in enumerate((9, 5))]
    training = model.training
    model.eval()  # no dropout: the two forwards must differ only in layout
    try:
        padded = policy_forward(model, collate(chunks), 1024, device, moe=False)
        packed = policy_forward(model, collate(chunks, packed=True), 1024, device, moe=False)
    finally:
        model.train(training)
    return bool(torch.allclose(packed.logprobs, padded.logprobs, atol=tolerance, rtol=0)
                and torch.allclose(packed.entropy, padded.entropy, atol=tolerance, rtol=0))


class TokenHead(torch.nn.Module):
    """The LM head applied to the loss positions' hidden rows, in chunks. A module of its own so
    that a backend which gathers parameters only inside a module's forward (DeepSpeed ZeRO-3) can
    be told that this forward uses the head's weight (`register_external_parameter`); the head
    is referenced, not registered as a child, so parameter names do not change."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.__dict__["head"] = head  # not a submodule

    def forward(self, hidden, targets, temperatures, chunk: int, recompute: bool = True, fp32: bool = False):
        """`fp32`: the head's matmul and softmax in float32 at least, outside autocast (bf16 logits
        are where the learner's and the engines' policies drift apart most); else in the dtype the
        model computes in. `recompute`: token_stats' checkpointed chunks, else its one-pass head."""
        weight, bias = adapted_weight(self.head), getattr(self.head, "bias", None)  # a LoRA head's adapter in
        if not fp32:
            return token_logprobs_and_entropy_from_hidden(hidden, weight, targets, temperatures, chunk, bias, recompute)
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            return token_logprobs_and_entropy_from_hidden(hidden.to(dtype), weight.to(dtype), targets, temperatures,
                                                          chunk, None if bias is None else bias.to(dtype), recompute)
