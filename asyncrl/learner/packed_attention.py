"""Attention over packed sequences at the cost of each sequence alone.

A packed micro-batch (collate.py) is one row of several sequences. Hugging Face's SDPA path keeps
them apart with a [N, N] block-diagonal mask, and the kernel still computes all N x N scores, the
masked ones too: where a step's sequences are many and short, that costs more than the padding
packing saved (on the tiny model, 0.72x the padded learner's tokens/s). flash-attention's varlen
kernel skips the masked blocks, but it exists only on GPUs.

`packed_sdpa` is SDPA run once per sequence of the row, causal within it, found from where the
position ids restart at 0; any other call (a padded batch, one sequence, a sliding window) goes
to Hugging Face's SDPA unchanged. `use_packed_attention` registers it under its own name (with
SDPA's mask function, which the other calls still need) and switches a model that uses SDPA to
it; flash-attention and eager models are left as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "asyncrl_packed_sdpa"


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function contract: query [B, H, N, D], key and value [B, H_kv, N, D]
    in, [B, N, H, D] out (and no weights)."""
    starts = sequence_starts(kwargs.get("position_ids"), query.shape[0], kwargs.get("sliding_window"))
    if starts is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    ends = starts[1:] + [query.shape[2]]
    gqa = query.shape[1] != key.shape[1]
    parts = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout,
                                            is_causal=True, scale=scaling, enable_gqa=gqa)
             for s, e in zip(starts, ends)]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def sequence_starts(position_ids: torch.Tensor | None, batch: int,
                    sliding_window: int | None = None) -> list[int] | None:
    """Where each packed sequence of a one-row batch starts (its position id is 0); None when the
    call is not a packed row of several sequences, or a sliding window needs the mask."""
    if position_ids is None or batch != 1 or sliding_window is not None:
        return None
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten().tolist()
    return starts if len(starts) > 1 and starts[0] == 0 else None


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch an SDPA model to `packed_sdpa`; whether it was switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, packed_sdpa)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
