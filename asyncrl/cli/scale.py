"""`asyncrl scale runs/<name> --actors 3`: change the number of rollout actors of a running run
(`python launch/scale.py` is the same).

Writes the request into the run directory (`SCALE_ACTORS`, asyncrl/orchestrator/requests.py); the
run applies it at its next step boundary and logs a `scale` event in events.jsonl. The learner is
not touched: new actors start in the background, join the weight-sync group and receive the
current weights before any prompt; removed actors' unfinished groups are generated again by the
others. On a Ray cluster with free resources, new actors land on any node.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SUMMARY = "change the number of rollout actors of a running run"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the run's directory, runs/<name>")
    p.add_argument("--actors", type=int, required=True, help="rollout actors wanted (>= 1)")
    return p.parse_args(argv)


def request_actors(run_dir: Path, actors: int) -> None:
    from asyncrl.orchestrator.requests import SCALE_FILE

    tmp = run_dir / f".{SCALE_FILE}.tmp"
    tmp.write_text(f"{actors}\n")
    tmp.rename(run_dir / SCALE_FILE)  # atomic: the run never reads half a request


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.actors < 1:
        print("error: --actors must be at least 1", file=sys.stderr)
        return 2
    if not (args.run_dir / "config.yaml").is_file():
        print(f"error: {args.run_dir} is not a run directory (no config.yaml)", file=sys.stderr)
        return 2
    request_actors(args.run_dir, args.actors)
    print(f"requested {args.actors} rollout actor(s); applied at the next step (see events.jsonl)")
    return 0
