"""Small all-reduces over the learner group (the default process group), for what every rank
must agree on: how many micro-batches to run, and the step's metrics over all loss tokens.

Values travel as float64 CPU tensors on gloo; NCCL only moves GPU tensors, so there they go
through the current CUDA device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asyncrl.learner.policy_step import Tally

# every key a tally may hold, in a fixed order: a rank without loss tokens has none of them
TALLY_KEYS = ("entropy", "behaviour_nll", "ratio", "abs_logp_diff", "clipped_low", "clipped_high",
              "clipped_dual", "is_weight_capped", "is_weight", "kl", "is_weight_masked", "masked")


def _tensor(values: list[float]) -> torch.Tensor:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    return torch.tensor(values, dtype=torch.float64, device=device)


def _all_reduce(values: list[float], op) -> list[float]:
    t = _tensor(values)
    dist.all_reduce(t, op=op)
    return t.cpu().tolist()


def max_over_ranks(value: int) -> int:
    return int(_all_reduce([value], dist.ReduceOp.MAX)[0])


def sum_over_ranks(value: float) -> float:
    return _all_reduce([value], dist.ReduceOp.SUM)[0]


def sum_tensor_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Elementwise sum over ranks of a tensor every rank holds in the same shape (float64, CPU)."""
    out = t.to(device=_tensor([]).device, dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.cpu()


def gather_over_ranks(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (same length on each), in rank order."""
    out = [_tensor([0.0] * len(values)) for _ in range(dist.get_world_size())]
    dist.all_gather(out, _tensor(values))
    return [[int(v) if float(v).is_integer() else v for v in t.cpu().tolist()] for t in out]


def all_reduce_tally(tally: Tally, scalars: dict[str, Any]) -> None:
    """Sums, token counts and loss terms summed over ranks; maxima and minima over ranks; the
    token tables concatenated in rank order. Tensors all the way: three all-reduces, and the
    tables as one padded tensor gather (no pickled per-token objects), no host copy."""
    dev, keys, names = _tensor([]).device, list(TALLY_KEYS), list(scalars)

    def column(values: dict[str, torch.Tensor], default: float) -> list[torch.Tensor]:
        return [values[k].to(dev, torch.float64) if k in values else torch.tensor(default, dtype=torch.float64,
                                                                                     device=dev) for k in keys]

    sums = torch.stack(column(tally.sums, 0.0) + [torch.as_tensor(scalars[n], dtype=torch.float64, device=dev)
                                                  for n in names] + [torch.tensor(float(tally.tokens), device=dev,
                                                                                  dtype=torch.float64)])
    present = torch.tensor([float(k in tally.sums) for k in keys], dtype=torch.float64, device=dev)
    maxima = torch.cat([torch.stack(column(tally.maxima, -float("inf"))), present])
    minima = torch.stack(column(tally.minima, float("inf")))
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)  # then: whether any rank saw the key
    dist.all_reduce(minima, op=dist.ReduceOp.MIN)
    seen = maxima[len(keys):].tolist()  # one small copy: which keys exist anywhere
    for i, k in enumerate(keys):
        if seen[i]:
            tally.sums[k], tally.maxima[k], tally.minima[k] = sums[i], maxima[i], minima[i]
    for j, n in enumerate(names):
        scalars[n] = sums[len(keys) + j]
    tally.tokens = int(sums[-1])
    for k in sorted(tally.vectors):  # the same keys and shapes on every rank (policy_step.MoeStep)
        tally.vectors[k] = sum_tensor_over_ranks(tally.vectors[k])
    if _any_rank(bool(tally.tables)):  # every rank asks: one with no micro-batches has no tables
        tally.tables = [cat_over_ranks(torch.cat(tally.tables, dim=1) if tally.tables else None)]


def _any_rank(flag: bool) -> bool:
    return bool(_all_reduce([float(flag)], dist.ReduceOp.MAX)[0])


def cat_over_ranks(t: torch.Tensor | None) -> torch.Tensor:
    """Every rank's 1-D tensor, or [R, N] matrix, concatenated in rank order along its last
    dimension (any length there): the shapes are gathered first, then each part padded to the
    longest and gathered as one tensor. None: nothing from this rank. Float64, on the CPU."""
    dev = _tensor([]).device
    mine = [0.0, 0.0, 0.0] if t is None else [float(t.dim()), float(t.shape[0] if t.dim() == 2 else 0),
                                               float(t.shape[-1])]
    shapes = gather_over_ranks(mine)
    rows, lengths = max(s[1] for s in shapes), [int(s[2]) for s in shapes]
    if t is None:
        t = torch.zeros((rows, 0) if max(s[0] for s in shapes) == 2 else (0,), dtype=torch.float64)
    padded = torch.nn.functional.pad(t.detach().to(dev, torch.float64), (0, max(lengths) - t.shape[-1]))
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[..., :n] for p, n in zip(parts, lengths)], dim=-1).cpu()
