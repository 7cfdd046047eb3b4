"""The twin against published asynchronous-RL speedups: every row of the scenarios in
configs/twin/published/ (AReaL, verl, NeMo-RL), the published ratio beside the twin's.

    python tools/twin_published.py                       every file in configs/twin/published/
    python tools/twin_published.py configs/twin/published/nemo_rl_llama8b.yaml --match NeMo
    python tools/twin_published.py --sensitivity         each row again at both ends of every assumed value

Each row runs the scenario's asynchronous mode and the baseline the source measured against
(`sync`: colocated; `sync_decoupled`: on the same split), the driver's time not charged, and
prints predicted against published. The last line is JSON: {"rows": [{"anchor", "baseline",
"published", "predicted", ...}], "within_15pct", "total", "expected"}; rows with a stated reason
are listed and not expected to match. `--sensitivity` reruns each row with each value its scenario
marks assumed (`assumed:` in the file, the low and high end of what is plausible) at either end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "configs" / "twin" / "published"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenarios", nargs="*", type=Path, help="published scenario files (default: all of them)")
    p.add_argument("--match", default=None, help="only rows whose anchor contains this text")
    p.add_argument("--sensitivity", action="store_true",
                   help="also each row at the low and high end of every value its scenario assumes")
    args = p.parse_args(argv)
    from asyncrl.twin.published import anchors, predict, sensitivity, summary, table

    paths = args.scenarios or sorted(PUBLISHED.glob("*.yaml"))
    todo = [(path, a) for path, a in anchors(paths) if args.match is None or args.match in a.anchor]
    if not todo:
        print(f"error: no published rows in {', '.join(map(str, paths))}"
              + (f" matching {args.match!r}" if args.match else ""), file=sys.stderr)
        return 2
    rows, cache, t0 = [], {}, time.monotonic()
    for i, (path, anchor) in enumerate(todo, 1):
        print(f"[{time.monotonic() - t0:6.0f}s] {i}/{len(todo)} {anchor.anchor} ...", flush=True)
        rows.append(predict(path, anchor, cache=cache))
        r = rows[-1]  # as it comes: a long table's early rows are not lost to a stopped run
        print(f"  published {r.published:.2f}x, twin {r.predicted:.2f}x ({r.error:+.0%})", flush=True)
        if args.sensitivity:
            r.sensitivity = sensitivity(path, anchor, cache=cache)
            for field, ends in r.sensitivity.items():
                print(f"  {field}: " + ", ".join(f"{v:g} -> {ratio:.2f}x" for v, ratio in ends), flush=True)
    print(table(rows))
    print(json.dumps(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
