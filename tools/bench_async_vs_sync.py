"""Asynchronous mode vs the synchronous step verl and TRL users run, on the same config:
trained tokens and samples per second, measured in one run.

    python tools/bench_async_vs_sync.py --steps 100 [--sync-prompts 8] [section.field=value ...]

- sync (the baseline): generate a rollout batch of `--sync-prompts` prompts with the current
  weights, train one optimizer step on every token of it, push, repeat
  (`buffer.rollout_batch_prompts = buffer.minibatch_prompts = N`, `max_staleness=0`). Nothing
  generated is thrown away, and generation and training take turns.
- async (asyncrl's default): actors generate all the time, each step takes the next Phi loss
  tokens (`buffer.token_budget`), tokens up to `max_staleness=1` versions old, in-flight pushes.

With the default 8 prompts x group_size 8 a synchronous step trains 64 samples, about what a
Phi = 512 step holds on the tiny task. Each mode starts its own Ray cluster and engines;
start-up is excluded (rates over the steps after the first `--warmup`). Prints a table, the
share of generated tokens each mode dropped as stale, and the ratio async / sync of trained
tokens per second.
"""

from __future__ import annotations

import argparse
import json
import time

from loop_bench import run_loop


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
    p.add_argument("--sync-prompts", type=int, default=8, help="prompts per synchronous step")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    t0 = time.monotonic()
    sync = run_mode("sync", args.steps, args.warmup, [*args.overrides, *sync_overrides(args.sync_prompts)])
    async_ = run_mode("async", args.steps, args.warmup, [*args.overrides, "buffer.max_staleness=1"])
    print(f"{'mode':<8}{'steps/s':>9}{'trained tok/s':>15}{'wait/step s':>13}{'stale dropped':>15}"
          f"{'reward(last10)':>16}")
    for name, r in (("sync", sync), ("async", async_)):
        print(f"{name:<8}{r['steps_per_s']:>9.2f}{r['trained_tokens_per_s']:>15,.0f}"
              f"{r['wait_for_data_s_per_step']:>13.3f}{r['stale_dropped_frac']:>15.1%}{r['reward_last_10']:>16.3f}")
    ratio = async_["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
    print(f"async / sync trained tokens per second: {ratio:.2f}x   (bench took {time.monotonic() - t0:.0f}s)")
    print(json.dumps({"sync": sync, "async": async_, "ratio": ratio}))


if __name__ == "__main__":
    main()
