"""Asynchronous mode vs the synchronous step verl and TRL users run, on the same config:
trained tokens, samples and reward gained per second, in alternating rounds.

    python tools/bench_async_vs_sync.py --steps 100 [--rounds 3] [--sync-prompts 8] [section.field=value ...]

- sync (the baseline): generate a rollout batch of `--sync-prompts` prompts with the current
  weights, train one optimizer step on every token of it, push, repeat
  (`buffer.rollout_batch_prompts = buffer.minibatch_prompts = N`, `max_staleness=0`). Nothing
  generated is thrown away, and generation and training take turns.
- async (asyncrl's default): actors generate all the time, each step takes the next Phi loss
  tokens (`buffer.token_budget`), tokens up to `max_staleness=1` versions old, in-flight pushes.

With the default 8 prompts x group_size 8 a synchronous step trains 64 samples, about what a
Phi = 512 step holds on the tiny task. Every round runs sync then async, each with its own Ray
cluster and engines (start-up excluded: rates over the steps after `--warmup`), and records the
cores other processes used meanwhile (tools/rounds.py). Prints every round, the median ratios
async / sync, and refuses to report them if the machine's other load differed between the sides.
"""

from __future__ import annotations

import argparse
import time

from loop_bench import run_loop
from rounds import alternate, report

KEYS = ("steps_per_s", "trained_tokens_per_s", "samples_per_s", "gain_per_s", "stale_dropped_frac", "other_cores")


def sync_overrides(prompts: int) -> list[str]:
    return ["buffer.max_staleness=0", f"buffer.rollout_batch_prompts={prompts}",
            f"buffer.minibatch_prompts={prompts}"]


def run_mode(name: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    r = run_loop(name, steps, warmup, overrides)
    del r["orchestrator"]
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sync-prompts", type=int, default=8, help="prompts per synchronous step")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    t0 = time.monotonic()
    results = alternate({
        "sync": lambda: run_mode("sync", args.steps, args.warmup, [*args.overrides, *sync_overrides(args.sync_prompts)]),
        "async": lambda: run_mode("async", args.steps, args.warmup, [*args.overrides, "buffer.max_staleness=1"]),
    }, args.rounds)
    report(results, KEYS, ("trained_tokens_per_s", "samples_per_s", "gain_per_s"), "async", "sync", t0)


if __name__ == "__main__":
    main()
