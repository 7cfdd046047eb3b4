"""`asyncrl run`: one training run (asyncrl/launch.py; `python launch/run.py` is the same)."""

from __future__ import annotations

import argparse

SUMMARY = "train one run: a recipe (default: the tiny CPU demo) and dotted overrides"


def parse_args(argv: list[str]) -> argparse.Namespace:
    from asyncrl import launch

    p = argparse.ArgumentParser(prog="asyncrl run", description=launch.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="YAML recipe, or a shipped one's name such as grpo (default: configs/tiny_cpu.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. buffer.token_budget=1024")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    from asyncrl.launch import launch

    args = parse_args(argv)
    return launch(args.config, args.overrides, args.print_config)
