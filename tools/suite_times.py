"""Where the test suite's time goes: pytest's per-test durations summed by file, and this machine's
figures to print beside them.

    python -m pytest tests --durations=0 --durations-min=1.0 | tee pytest.log
    python tools/suite_times.py pytest.log            # per-file totals, slowest first, and the
                                                      # share of the cores they left idle
    python tools/suite_times.py --calibrate           # this machine's loops, cores and imports

The suite is mostly process starts (Python importing torch, vLLM and Ray in each engine, learner
rank and driver). Its time differs between machines of one kind: the same commit's pytest took
2,142 s in one session and 4,397 s in a later one, every file about twice as long, and slow runs
came with a pure-Python loop of about 1 s as well as 3.9 s. So the calibration also times the
imports the suite is made of (vLLM's: about 12 s on an idle 2-core machine, twice per engine
start) and whether two processes really run at once. CI prints it beside each run
(docs/testing.md)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from asyncrl.compat import usable_cores

# pytest's `--durations` lines: "12.34s call     tests/e2e/test_x.py::test_y[param]"
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+?)::")
# tests/conftest.py's summary: "idle 12.3 of 60.4 core-s  tests/e2e/test_x.py::test_y[param]"
IDLE = re.compile(r"^idle (\d+(?:\.\d+)?) of (\d+(?:\.\d+)?) core-s\s+(\S+?)::")


def per_file(lines) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown together) from pytest's durations lines;
    other lines are ignored."""
    totals: dict[str, float] = defaultdict(float)
    for line in lines:
        if m := DURATION.match(line.strip()):
            totals[m.group(3)] += float(m.group(1))
    return dict(totals)


def idle_per_file(lines) -> dict[str, tuple[float, float]]:
    """(idle core-seconds, core-seconds the machine had) per test file, from tests/conftest.py's
    summary lines: where the suite waits instead of working."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for line in lines:
        if m := IDLE.match(line.strip()):
            totals[m.group(3)][0] += float(m.group(1))
            totals[m.group(3)][1] += float(m.group(2))
    return {f: (idle, had) for f, (idle, had) in totals.items()}


# Fresh-interpreter imports timed by --calibrate: torch (every learner rank, driver and Ray worker)
# and vLLM's AsyncLLM, which every engine start imports twice (its actor, then the engine core it spawns).
IMPORTS = {
    "import_torch_s": "import torch",
    "import_vllm_s": "from asyncrl.compat import hide_broken_torch_extras; hide_broken_torch_extras(); "
                     "import vllm.v1.engine.async_llm",
}
# in a function, as the figures quoted in docs/testing.md were timed (a module-level loop is ~2x slower)
LOOP = "def loop(n):\n    total = 0\n    for i in range(n):\n        total += i\nloop({n})"


def calibrate(loop: int = 20_000_000, imports: dict[str, str] = IMPORTS) -> dict[str, float]:
    """This machine's figures for a start-heavy suite: a pure-Python loop of `loop` additions, the
    same loop in two processes at once (about the one loop's time when two cores are free, twice it
    when one is), the usable cores, and each statement of `imports` in a fresh interpreter."""
    start = time.perf_counter()
    exec(LOOP.format(n=loop), {})
    got = {"python_loop_s": time.perf_counter() - start}
    start = time.perf_counter()
    both = [subprocess.Popen([sys.executable, "-c", LOOP.format(n=loop)], stdout=subprocess.DEVNULL) for _ in range(2)]
    if any([p.wait() for p in both]):  # a list: both are waited for, even when the first failed
        raise RuntimeError("a calibration loop failed")
    got["two_loops_s"] = time.perf_counter() - start
    for name, statement in imports.items():
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"calibration import failed: {statement}\n{done.stderr[-2000:]}")
        got[name] = time.perf_counter() - start
    return {**{k: round(v, 2) for k, v in got.items()}, "cpus": usable_cores()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", nargs="?", type=Path, help="a pytest log run with --durations=0 (default: stdin)")
    p.add_argument("--calibrate", action="store_true", help="time this machine instead (loops, cores, imports)")
    p.add_argument("--top", type=int, default=25, help="files to list (default 25)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args(argv)
    if args.calibrate:
        print(json.dumps(calibrate()))
        return 0
    text = args.log.read_text(errors="replace") if args.log else sys.stdin.read()
    totals, idle = per_file(text.splitlines()), idle_per_file(text.splitlines())
    if not totals:
        print("no pytest duration lines found: run pytest with --durations=0", file=sys.stderr)
        return 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    if args.json:
        print(json.dumps({"total_s": round(sum(totals.values()), 1),
                          "files": {f: round(s, 1) for f, s in ranked},
                          "idle_core_s": {f: round(idle[f][0], 1) for f, _ in ranked if f in idle}}))
        return 0
    for name, seconds in ranked[:args.top]:
        share = f"  {idle[name][0] / idle[name][1]:4.0%} idle" if idle.get(name, (0, 0))[1] else ""
        print(f"{seconds:9.1f} s{share}  {name}")
    print(f"{sum(totals.values()):9.1f} s  in all ({len(totals)} files; tests under the durations' minimum "
          "not counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
