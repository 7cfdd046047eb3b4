"""Small all-reduces over the learner group (the default process group), for what every rank
must agree on: how many micro-batches to run, and the step's metrics over all loss tokens.

Values travel as float64 CPU tensors on gloo; NCCL only moves GPU tensors, so there they go
through the current CUDA device.
"""

from __future__ import annotations

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


def all_reduce_tally(tally: Tally, scalars: dict[str, float]) -> None:
    """Sums, token counts and loss terms summed over ranks; maxima and minima over ranks."""
    keys, names = list(TALLY_KEYS), list(scalars)
    sums = _all_reduce([tally.sums.get(k, 0.0) for k in keys] + [scalars[n] for n in names] + [tally.tokens],
                       dist.ReduceOp.SUM)
    maxima = _all_reduce([tally.maxima.get(k, -float("inf")) for k in keys] + [float(k in tally.sums) for k in keys],
                         dist.ReduceOp.MAX)  # then: whether any rank saw the key
    minima = _all_reduce([tally.minima.get(k, float("inf")) for k in keys], dist.ReduceOp.MIN)
    for i, k in enumerate(keys):
        if maxima[len(keys) + i]:
            tally.sums[k], tally.maxima[k], tally.minima[k] = sums[i], maxima[i], minima[i]
    for j, n in enumerate(names):
        scalars[n] = sums[len(keys) + j]
    tally.tokens = int(sums[-1])
    for k in sorted(tally.vectors):  # the same keys and shapes on every rank (policy_step.MoeStep)
        tally.vectors[k] = sum_tensor_over_ranks(tally.vectors[k])
    tables = [None] * dist.get_world_size()  # the off-policy decomposition needs every token
    dist.all_gather_object(tables, tally.tables)
    tally.tables = [t for part in tables for t in part]


def cat_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D tensor (any length), concatenated in rank order (float64, CPU)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t.detach().double().cpu())
    return torch.cat(parts)
