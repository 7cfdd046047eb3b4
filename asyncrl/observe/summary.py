"""End-of-run summary: reward over the first and last fifth of steps, and where things went."""

from __future__ import annotations

from typing import Any


def fifth_means(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last fifth (at least one value each)."""
    if not values:
        raise ValueError("no values")
    k = max(1, len(values) // 5)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def _max_of(history: list[dict[str, Any]], key: str) -> int:
    return max((h.get(key) or 0 for h in history), default=0)


def summarize(history: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    rewards = [h["reward/mean"] for h in history if h.get("reward/mean") is not None]
    first, last = fifth_means(rewards) if rewards else (float("nan"), float("nan"))
    return {
        "steps": len(history),
        "wall_s": round(wall_s, 1),
        "reward_first_fifth": round(first, 4),
        "reward_last_fifth": round(last, 4),
        "reward_gain": round(last - first, 4),
        "max_staleness_seen": _max_of(history, "staleness/max"),
        # the two parts of a lag (orchestrator/step_stats.py): training a rollout batch for N_SGD
        # steps, and generating while the learner moves on
        "max_async_staleness_seen": _max_of(history, "staleness/async_max"),
        "max_reuse_lag_seen": _max_of(history, "staleness/reuse_max"),
        "tokens_trained": sum(int(h.get("learner/loss_tokens", 0)) for h in history),
    }


def format_summary(s: dict[str, Any], run_dir: str) -> str:
    staleness = f"{s['max_staleness_seen']}"
    if s.get("max_reuse_lag_seen", 0) > 0:
        staleness += (f" ({s['max_reuse_lag_seen']} after entering training, "
                      f"{s.get('max_async_staleness_seen', 0)} asynchronous)")
    wall = f"{s['wall_s']}s"
    if s.get("resumed_at_step") is not None:  # wall_s counts the parts before the resume too
        wall += f" ({s['wall_s_since_resume']}s since the resume at step {s['resumed_at_step']})"
    lost = s.get("actors_lost") or []
    lost_line = (f"  rollout actors lost: {len(lost)} (" + "; ".join(
        f"actor {a['actor']} at step {a['step']}: {str(a['reason'])[:100]}" for a in lost[:3])
        + ("; ..." if len(lost) > 3 else "") + ")\n") if lost else ""
    return (
        f"\nasyncrl run finished: {s['steps']} steps in {wall}\n"
        f"  reward, first fifth of steps: {s['reward_first_fifth']:.3f}\n"
        f"  reward, last fifth of steps:  {s['reward_last_fifth']:.3f}  ({s['reward_gain']:+.3f})\n"
        f"  tokens trained: {s['tokens_trained']:,}   max staleness: {staleness}\n"
        f"{lost_line}"
        f"  run directory: {run_dir}\n"
    )
