"""Entry point: `python launch/run.py [--config configs/<recipe>.yaml] [section.field=value ...]`.

Starts a local Ray cluster, or joins the one `ray job submit` (or RAY_ADDRESS / ray.address)
points at, then hands the config to the orchestrator. With no --config it runs the tiny CPU
default, which trains the locally built tiny model on the built-in arithmetic task.

SIGTERM or SIGINT (Ctrl-C, `ray job stop`) stops the run cleanly: no new prompts, the running step
finishes, a checkpoint is written, everything shuts down; `resume=auto` continues it. A second
signal exits at once. Exit codes: 0 finished, 1 failed (learner lost: resume from the newest
checkpoint), 2 bad config, 128 + signal number after a clean stop.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML recipe (default: configs/tiny_cpu.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. buffer.token_budget=1024")
    return p.parse_args(argv)


def connect_ray(address: str | None, num_cpus: int | None) -> None:
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from asyncrl.config import ConfigError, load_config

    args = parse_args(sys.argv[1:] if argv is None else argv)
    from asyncrl.reward.registry import check_functions

    try:
        cfg = load_config(args.config, args.overrides)
        check_functions(cfg.reward)  # before Ray starts: a misspelt reward function fails in a second
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.orchestrator.checkpointer import LearnerDied
    from asyncrl.orchestrator.orchestrator import Orchestrator

    hide_broken_torch_extras()  # before Ray starts: its workers inherit the environment
    connect_ray(cfg.ray.address, cfg.ray.num_cpus)
    try:
        orch = Orchestrator(cfg)
    except ConfigError as e:  # checks that need the data or imports: sources, reward functions
        print(f"error: {e}", file=sys.stderr)
        return 2
    stopped = install_stop_handlers(orch)
    try:
        orch.run()
    except ConfigError as e:  # found at start: a checkpoint that does not fit this config, data sources
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LearnerDied as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        orch.shutdown()
    return 128 + stopped[0] if stopped else 0


def install_stop_handlers(orch) -> list[int]:
    """First SIGTERM/SIGINT: a clean stop with a checkpoint; a second: exit now. Installed after
    Ray starts, which sets its own SIGTERM handler in the driver."""
    got: list[int] = []

    def handler(signum, frame):
        if got:
            os._exit(128 + signum)
        got.append(signum)
        name = signal.Signals(signum).name
        print(f"\n{name}: stopping after the running step and writing a checkpoint "
              "(send it again to exit at once)", file=sys.stderr, flush=True)
        orch.request_stop(name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return got


if __name__ == "__main__":
    sys.exit(main())
