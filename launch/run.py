"""Entry point: `python launch/run.py [--config configs/<recipe>.yaml] [section.field=value ...]`.

Starts a local Ray cluster, or joins the one `ray job submit` (or RAY_ADDRESS / ray.address)
points at, then hands the config to the orchestrator. With no --config it runs the tiny CPU
default, which trains the locally built tiny model on the built-in arithmetic task.
"""

from __future__ import annotations

import argparse
import logging
import os
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
    from asyncrl.orchestrator.orchestrator import Orchestrator

    hide_broken_torch_extras()  # before Ray starts: its workers inherit the environment
    connect_ray(cfg.ray.address, cfg.ray.num_cpus)
    try:
        orch = Orchestrator(cfg)
    except ConfigError as e:  # checks that need the data or imports: sources, reward functions
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        orch.run()
    finally:
        orch.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
