"""The twin against published asynchronous-RL speedups: every row of the scenarios in
configs/twin/published/ (AReaL, verl, NeMo-RL), the published ratio beside the twin's.

    python tools/twin_published.py                       every file in configs/twin/published/
    python tools/twin_published.py configs/twin/published/nemo_rl_llama8b.yaml --match NeMo

Each row runs the scenario's asynchronous mode and the baseline the source measured against
(`sync`: colocated; `sync_decoupled`: on the same split), the driver's time not charged, and
prints predicted against published. The last line is JSON: {"rows": [{"anchor", "baseline",
"published", "predicted", ...}], "within_15pct", "total", "expected"}; rows with a stated reason
are listed and not expected to match.
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
    args = p.parse_args(argv)
    from asyncrl.twin.published import anchors, predict, summary, table

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
    print(table(rows))
    print(json.dumps(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
