"""Where the test suite's time goes: pytest's per-test durations summed by file, and two figures of
this machine's speed to print beside them.

    python -m pytest tests --durations=0 --durations-min=1.0 | tee pytest.log
    python tools/suite_times.py pytest.log            # per-file totals, slowest first
    python tools/suite_times.py --calibrate           # this machine's single-thread figures

The suite is mostly process starts (Python importing torch, vLLM and Ray in each engine, learner
rank and driver). Its time differs between machines of one kind: the same commit's pytest took
2,142 s in one session and 4,397 s in a later one, every file about twice as long. The
calibration (a pure-Python loop and a fresh `import torch`) is printed beside each CI run so that
two suite times come with their machines' figures; it does not yet explain that gap
(docs/testing.md).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

# pytest's `--durations` lines: "12.34s call     tests/e2e/test_x.py::test_y[param]"
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+?)::")


def per_file(lines) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown together) from pytest's durations lines;
    other lines are ignored."""
    totals: dict[str, float] = defaultdict(float)
    for line in lines:
        if m := DURATION.match(line.strip()):
            totals[m.group(3)] += float(m.group(1))
    return dict(totals)


def calibrate(loop: int = 20_000_000) -> dict[str, float]:
    """Seconds for a pure-Python loop of `loop` additions, and for `import torch` in a fresh
    interpreter: the two things a start-heavy suite is made of."""
    start = time.perf_counter()
    total = 0
    for i in range(loop):
        total += i
    loop_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return {"python_loop_s": round(loop_s, 2), "import_torch_s": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", nargs="?", type=Path, help="a pytest log run with --durations=0 (default: stdin)")
    p.add_argument("--calibrate", action="store_true", help="time this machine's single thread instead")
    p.add_argument("--top", type=int, default=25, help="files to list (default 25)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args(argv)
    if args.calibrate:
        print(json.dumps(calibrate()))
        return 0
    text = args.log.read_text(errors="replace") if args.log else sys.stdin.read()
    totals = per_file(text.splitlines())
    if not totals:
        print("no pytest duration lines found: run pytest with --durations=0", file=sys.stderr)
        return 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    if args.json:
        print(json.dumps({"total_s": round(sum(totals.values()), 1),
                          "files": {f: round(s, 1) for f, s in ranked}}))
        return 0
    for name, seconds in ranked[:args.top]:
        print(f"{seconds:9.1f} s  {name}")
    print(f"{sum(totals.values()):9.1f} s  in all ({len(totals)} files; tests under the durations' minimum "
          "not counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
