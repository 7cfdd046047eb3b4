"""Turn a micro-batch of SequenceChunks into model inputs and flat loss-token indices.

A chunk is fed as prompt + response[:loss_end]; the logit at position p predicts the token at
p + 1, so response token j (absolute position P + j, P the prompt length) is scored by the logit
row P + j - 1. Everything the loss needs is gathered into flat [T] vectors over loss tokens.

Two layouts of the same micro-batch:
- packed (`packed=True`): one row [1, N], the sequences back to back with no padding, and
  position ids that restart at 0 for each. Hugging Face models read restarting positions (with
  no attention mask) as packed sequences and keep attention within each: flash-attention's
  varlen kernel on GPUs, a block-diagonal mask for SDPA and eager attention.
- padded: one row per sequence [B, L], right-padded, with an attention mask; every row is as
  long as the longest, so RL's spread of lengths makes a large part of it padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.algo.distill import distill_advantages
from asyncrl.types import SequenceChunk


@dataclass
class MicroBatch:
    input_ids: torch.Tensor       # [B, L] int64, right-padded; [1, N] packed
    attention_mask: torch.Tensor  # [B, L] int64; packed: all ones (it marks the routed positions)
    rows: torch.Tensor            # [T] batch row of each loss token
    cols: torch.Tensor            # [T] logit column that predicts it
    targets: torch.Tensor         # [T] the loss token ids
    old_logprobs: torch.Tensor    # [T] behaviour logprobs
    advantages: torch.Tensor      # [T]
    versions: torch.Tensor        # [T] int64
    seq_loss_tokens: torch.Tensor  # [T] int64: loss tokens of the token's sequence in this step
    temperatures: torch.Tensor    # [T] sampling temperature of the token's response
    response_lengths: torch.Tensor  # [T] int64: length of the token's whole response
    spans: list[tuple[str, int, int, int]] = field(default_factory=list)
    """(group_id, sample_index, loss_start, loss_end) of each chunk, in the order of its tokens."""
    span_tokens: list[int] = field(default_factory=list)
    """Loss tokens of each chunk (fewer than its span where an episode's observations are masked)."""
    position_ids: torch.Tensor | None = None
    """Packed: [1, N] int64, restarting at 0 for each sequence (the model is then given these and
    no attention mask); None: padded."""
    routed_experts: torch.Tensor | None = None
    """Routing replay: [B * L] rows (input_ids flattened) of uint8 [layers * top-k], the experts the
    engine routed each position to, 255 for none (padding, or a position the engine did not
    record); None: no chunk carries routing (learner/replay.py)."""

    @property
    def num_loss_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def num_input_tokens(self) -> int:
        """Positions the forward computes, padding included."""
        return int(self.input_ids.numel())

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for this layout."""
        if self.position_ids is not None:  # no mask and no cache: what HF reads as packed sequences
            return {"input_ids": self.input_ids.to(device), "position_ids": self.position_ids.to(device),
                    "use_cache": False}
        return {"input_ids": self.input_ids.to(device), "attention_mask": self.attention_mask.to(device),
                "use_cache": False}  # a training forward: no cache (and none to clash with checkpointing)

    def sequence_ids(self) -> torch.Tensor:
        """[T] int64: the index of each loss token's chunk (its "sequence" for GSPO and seq_tis)."""
        counts = self.span_tokens or [end - start for _, _, start, end in self.spans]
        return torch.repeat_interleave(torch.arange(len(self.spans)), torch.tensor(counts, dtype=torch.long))


def collate(chunks: list[SequenceChunk], pad_id: int = 0, packed: bool = False,
            distill_coef: float = 0.0) -> MicroBatch:
    """The micro-batch in the packed or the padded layout (module docstring). With `distill_coef`
    (algo.distill), each token's advantage gains coef * (log pi_teacher - log pi_b) where its
    chunk carries teacher logprobs (algo/distill.py)."""
    seqs = [c.prompt_ids + c.response_ids for c in chunks]
    if packed:
        starts = [0]
        for seq in seqs[:-1]:
            starts.append(starts[-1] + len(seq))
        ids = torch.tensor([[t for seq in seqs for t in seq]], dtype=torch.long)
        mask = torch.ones_like(ids)
        positions = torch.tensor([[i for seq in seqs for i in range(len(seq))]], dtype=torch.long)
    else:
        width = max(map(len, seqs))
        ids = torch.full((len(chunks), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunks), width), dtype=torch.long)
        for b, seq in enumerate(seqs):
            ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[b, : len(seq)] = 1
        starts, positions = [0] * len(chunks), None
    rows, cols, targets, old, adv, ver, seq_len, temps, lengths, teacher = [], [], [], [], [], [], [], [], [], []
    for b, c in enumerate(chunks):
        row, offset = (0, starts[b]) if packed else (b, 0)
        p, n = len(c.prompt_ids), c.num_loss_tokens
        # an episode's observation tokens (loss_mask 0) are context: they get no loss term at all
        keep = range(n) if not c.loss_mask else [i for i, m in enumerate(c.loss_mask) if m]
        for i in keep:
            rows.append(row)
            cols.append(offset + p + c.loss_start + i - 1)
            targets.append(c.response_ids[c.loss_start + i])
        old.extend(c.old_logprobs if not c.loss_mask else [c.old_logprobs[i] for i in keep])
        if distill_coef:  # a chunk without the teacher's (a rank's empty one) gets no term: pi_b for pi_teacher
            taught = c.teacher_logprobs or c.old_logprobs
            teacher.extend(taught if not c.loss_mask else [taught[i] for i in keep])
        ver.extend(c.versions if not c.loss_mask else [c.versions[i] for i in keep])
        adv.extend([c.advantage] * n)
        seq_len.extend([n] * n)
        temps.extend([c.temperature] * n)
        lengths.extend([c.response_length or c.loss_end] * n)
    routes = _routes(chunks, starts, ids.shape[1], packed) if any(c.routed_experts for c in chunks) else None
    old_t, adv_t = torch.tensor(old, dtype=torch.float32), torch.tensor(adv, dtype=torch.float32)
    if distill_coef:
        adv_t = distill_advantages(adv_t, torch.tensor(teacher, dtype=torch.float32), old_t, distill_coef)
    return MicroBatch(
        input_ids=ids, attention_mask=mask,
        rows=torch.tensor(rows, dtype=torch.long), cols=torch.tensor(cols, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        old_logprobs=old_t, advantages=adv_t,
        versions=torch.tensor(ver, dtype=torch.long),
        seq_loss_tokens=torch.tensor(seq_len, dtype=torch.long),
        temperatures=torch.tensor(temps, dtype=torch.float32),
        response_lengths=torch.tensor(lengths, dtype=torch.long),
        spans=[(c.group_id, c.sample_index, c.loss_start, c.loss_end) for c in chunks],
        span_tokens=[c.num_loss_tokens for c in chunks],
        position_ids=positions, routed_experts=routes,
    )


def _routes(chunks: list[SequenceChunk], starts: list[int], width: int, packed: bool) -> torch.Tensor:
    """The chunks' routing rows laid out as input_ids flattened (module docstring's two layouts)."""
    row = {len(c.routed_experts) // c.num_tokens for c in chunks if c.routed_experts}
    if len(row) != 1:
        raise ValueError(f"a micro-batch's chunks carry routing rows of different widths {sorted(row)}")
    out = torch.full((len(chunks) * width if not packed else width, row.pop()), 255, dtype=torch.uint8)
    for b, c in enumerate(chunks):
        if c.routed_experts:
            at = starts[b] if packed else b * width
            out[at:at + c.num_tokens] = torch.frombuffer(bytearray(c.routed_experts), dtype=torch.uint8
                                                         ).view(c.num_tokens, -1)
    return out


def empty_chunk(pad_id: int = 0) -> SequenceChunk:
    """A one-token sequence for a micro-batch that must run but carries no loss (a rank with
    fewer micro-batches than the busiest one); its loss is multiplied by zero."""
    return SequenceChunk(group_id="", sample_index=0, prompt_ids=[pad_id], response_ids=[pad_id], loss_start=0,
                         old_logprobs=[0.0], versions=[0], advantage=0.0)
