"""A study run's fixed cost, warm (the runs share one Ray cluster, engine set and learner:
asyncrl/orchestrator/warm.py) against cold (`--cold`: each run an `asyncrl run` process of its own,
the baseline), measured as a user runs a study: `asyncrl study` on a 3-seed study of the demo.

    python tools/bench_study_cost.py                # 2 rounds, 3 seeds x 20 steps
    python tools/bench_study_cost.py --rounds 3 --steps 40

Fixed cost per run = (the study command's wall time - the sum of its runs' step times) / runs,
with a step's time its `timing/step_wall_s` (from one step's end to the next's, so waiting for
data counts as step time, not as fixed cost). The two sides alternate in rounds (warm, cold, then
cold, warm, ...), so drift on a shared machine falls on both; run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STUDY = """name: bench_cost
description: the demo on three seeds, to measure a study run's fixed cost
base: tiny_cpu
overrides:
  eval.every_steps: 0
  observe.tensorboard: false
total_steps: {steps}
seeds: [0, 1, 2]
arms:
  - {{name: demo, overrides: {{}}}}
"""


def one_study(study: Path, out: Path, cold: bool) -> tuple[float, float, int]:
    """(wall seconds, sum of step seconds, runs) of one `asyncrl study` invocation."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "asyncrl", "study", str(study), f"observe.output_dir={out}", *(["--cold"] if cold else [])]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    runs = sorted((out / "bench_cost").glob("demo-s*/metrics.jsonl"))
    steps = sum(json.loads(line)["timing/step_wall_s"] for path in runs for line in path.read_text().splitlines())
    return wall, steps, len(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="steps per run")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_study_cost_"))
    study = work / "bench_cost.yaml"
    study.write_text(STUDY.format(steps=args.steps))
    fixed: dict[str, list[float]] = {"warm": [], "cold": []}
    try:
        for r in range(args.rounds):
            for side in (("warm", "cold") if r % 2 == 0 else ("cold", "warm")):
                wall, steps, runs = one_study(study, work / side, cold=side == "cold")
                fixed[side].append((wall - steps) / runs)
                print(f"round {r + 1} {side}: {wall:.1f} s for {runs} runs, {steps:.1f} s of steps: "
                      f"fixed cost {fixed[side][-1]:.1f} s a run", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    warm, cold = (sum(v) / len(v) for v in (fixed["warm"], fixed["cold"]))
    print(f"fixed cost a run: warm {warm:.1f} s, cold {cold:.1f} s (cold / warm = {cold / warm:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
