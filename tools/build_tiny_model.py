"""Build (or find in the cache) the tiny warm-started model and print its path and accuracies.

    python tools/build_tiny_model.py                          # the default spec the demo uses
    python tools/build_tiny_model.py --config tiny_tool       # a recipe's model (the tiny agent's)
    python tools/build_tiny_model.py --target-accuracy 0.5    # stop the warm start later
    python tools/build_tiny_model.py --target-accuracy none --soften-to 0.3   # the old softened start
    python tools/build_tiny_model.py --target-accuracy none --checkpoints ckpts/   # every check saved

The warm start trains until the sampled accuracy (temperature 1, as rollouts sample) on the train
problems reaches --target-accuracy (asyncrl/tiny/build.py). The model is cached under
$ASYNCRL_CACHE (default ~/.cache/asyncrl), keyed by the spec. --checkpoints builds afresh (no
cache) and also saves the model at every accuracy check, as DIR/step_<N>/, beside DIR/final/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from asyncrl.tiny.build import TinyModelSpec, build_into, ensure_tiny_model
from asyncrl.tiny.task import TinyTaskSpec


def optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def parse_spec(argv: list[str] | None = None) -> tuple[TinyModelSpec, argparse.Namespace]:
    """Command-line options over the default spec; unset options keep the defaults."""
    defaults, task_defaults = TinyModelSpec(), TinyTaskSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--heads", type=int, default=defaults.num_heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.num_kv_heads)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--steps", type=int, default=defaults.warm_start_steps,
                        help="length of the supervised schedule and the most steps trained")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--target-accuracy", type=optional_float, default=defaults.target_sampled_accuracy,
                        help="stop when the sampled accuracy on train problems reaches this, or 'none'")
    parser.add_argument("--check-every", type=int, default=defaults.check_every, help="steps between accuracy checks")
    parser.add_argument("--soften-to", type=optional_float, default=defaults.soften_to_probability,
                        help="after training, bake in the temperature that brings the right answer's probability "
                             "to this, or 'none' (the default)")
    parser.add_argument("--max-operand", type=int, default=task_defaults.max_operand)
    parser.add_argument("--ops", default=task_defaults.ops, help="operators, any of '+-*'")
    parser.add_argument("--cache-dir", default=None, help="default: $ASYNCRL_CACHE or ~/.cache/asyncrl")
    parser.add_argument("--checkpoints", default=None, help="build into this directory, saving every check")
    parser.add_argument("--config", default=None,
                        help="the built-in model of this recipe (a path or a shipped name, e.g. tiny_tool) instead "
                             "of the options above: its path is what model.path takes to train it on other data")
    args = parser.parse_args(argv)
    if args.config:
        from asyncrl.config import load_config
        from asyncrl.tiny.spec import spec_for

        return spec_for(load_config(args.config).model.tiny), args
    spec = dataclasses.replace(
        defaults, seed=args.seed, num_layers=args.layers, hidden_size=args.hidden_size, num_heads=args.heads,
        num_kv_heads=args.kv_heads, intermediate_size=args.intermediate_size, warm_start_steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, target_sampled_accuracy=args.target_accuracy,
        check_every=args.check_every, soften_to_probability=args.soften_to,
        task=dataclasses.replace(task_defaults, max_operand=args.max_operand, ops=args.ops),
    )
    return spec, args


def main(argv: list[str] | None = None) -> None:
    spec, args = parse_spec(argv)
    if args.checkpoints:
        path = Path(args.checkpoints) / "final"
        path.mkdir(parents=True, exist_ok=True)
        build_into(path, spec, checkpoints_dir=Path(args.checkpoints))
    else:
        path = ensure_tiny_model(spec, cache_dir=args.cache_dir)
    report = json.loads((path / "warm_start.json").read_text())
    print(path)
    for split in ("eval", "train"):
        print(
            f"{split}: sampled (T=1) accuracy {report[f'{split}_sampled_accuracy']:.3f}, "
            f"greedy accuracy {report[f'{split}_greedy_accuracy']:.3f} on {report['num_prompts']} prompts"
        )
    stop = "reached the target" if report["reached_target"] else "no target reached"
    softened = (f", softened at temperature {report['softening_temperature']:.2f}"
                if "softening_temperature" in report else "")
    print(f"warm start: {report['steps']} steps in {report['train_seconds']:.1f}s ({stop}){softened}")


if __name__ == "__main__":
    main()
