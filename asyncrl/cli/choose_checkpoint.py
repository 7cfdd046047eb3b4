"""`asyncrl choose-checkpoint`: the SFT checkpoint to start RL from, by its token entropy on the
RL prompts (asyncrl/lab/offline/checkpoint_entropy.py measures, entropy_band.py decides).

    asyncrl choose-checkpoint sft/epoch1 sft/epoch3 sft/epoch5 --config my.yaml --band 0.3 0.5
    asyncrl choose-checkpoint a b c --band 0.2 0.6 --prefer lowest --num-prompts 128 --n 4

Prints the table and the choice (its path alone on the last line of stdout). Exit codes: 0
chosen, 1 none in the band (the error says which side each fell on), 2 bad arguments, config or data.
"""

from __future__ import annotations

import argparse
import sys

SUMMARY = "the SFT checkpoint whose token entropy on the RL prompts is in a band"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl choose-checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", help="SFT checkpoint directories (Hugging Face format)")
    p.add_argument("--band", type=float, nargs=2, required=True, metavar=("LOW", "HIGH"),
                   help="target entropy band in nats (Ring-lite's models: 0.3 0.5)")
    p.add_argument("--prefer", choices=("center", "lowest", "highest"), default="center",
                   help="among several in the band (default: closest to its middle)")
    p.add_argument("--config", default=None, help="the RL recipe: data fields, verifiers, sampling")
    p.add_argument("--data", default=None, help="RL prompts jsonl (default: the config's training data)")
    p.add_argument("--num-prompts", type=int, default=64, help="the first this many prompts (default 64)")
    p.add_argument("--n", type=int, default=4, help="responses per prompt (default 4)")
    p.add_argument("--temperature", type=float, default=None, help="default: the first stage's")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the first stage's")
    return p.parse_args(argv)


def measure(args: argparse.Namespace, engine=None):
    """Every checkpoint's CheckpointEntropy (a coroutine; `engine`: a started PolicyEngine)."""
    from asyncrl.lab.offline.checkpoint_entropy import measure_checkpoints

    return measure_checkpoints(args.checkpoints, args.num_prompts, args.n, args.config, args.data,
                               args.temperature, args.max_tokens, engine)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import asyncio

    from asyncrl.cli.engine_work import run_engine_work
    from asyncrl.config import ConfigError
    from asyncrl.lab.offline.checkpoint_entropy import entropy_table
    from asyncrl.lab.offline.entropy_band import NoneInBand, choose

    def work():
        if not args.band[0] < args.band[1]:
            raise ConfigError(f"--band: LOW must be below HIGH, got {args.band}")
        return asyncio.run(measure(args))

    measured = run_engine_work(work)
    if measured is None:
        return 2
    print(entropy_table(measured))
    try:
        chosen = choose(measured, *args.band, prefer=args.prefer)
    except NoneInBand as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"chosen ({args.prefer} of the band [{args.band[0]:g}, {args.band[1]:g}]): entropy {chosen.entropy:.4f}")
    print(chosen.path)
    return 0
