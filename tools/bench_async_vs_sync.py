"""Asynchronous vs synchronous mode on the same config: optimizer steps and trained tokens per
second, measured in one run (synchronous mode, max_staleness 0, is the baseline).

    python tools/bench_async_vs_sync.py --steps 100 [section.field=value ...]

Each mode starts its own Ray cluster and engines; start-up is excluded (rates are taken over
the steps after the first `--warmup`). Prints a table and the ratio async / sync.
"""

from __future__ import annotations

import argparse
import json
import time

from loop_bench import run_loop


def run_mode(staleness: int, steps: int, warmup: int, overrides: list[str]) -> dict:
    r = run_loop(f"staleness{staleness}", steps, warmup, [*overrides, f"buffer.max_staleness={staleness}"])
    del r["orchestrator"]
    return {"max_staleness": staleness, **r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    t0 = time.monotonic()
    sync = run_mode(0, args.steps, args.warmup, args.overrides)
    async_ = run_mode(1, args.steps, args.warmup, args.overrides)
    print(f"{'mode':<22}{'steps/s':>10}{'tokens/s':>12}{'wait/step s':>13}{'reward(last10)':>16}")
    for name, r in (("sync (staleness 0)", sync), ("async (staleness 1)", async_)):
        print(f"{name:<22}{r['steps_per_s']:>10.2f}{r['trained_tokens_per_s']:>12,.0f}"
              f"{r['wait_for_data_s_per_step']:>13.3f}{r['reward_last_10']:>16.3f}")
    ratio = async_["steps_per_s"] / sync["steps_per_s"]
    print(f"async / sync steps per second: {ratio:.2f}x   (bench took {time.monotonic() - t0:.0f}s)")
    print(json.dumps({"sync": sync, "async": async_, "ratio": ratio}))


if __name__ == "__main__":
    main()
