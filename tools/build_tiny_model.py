"""Build (or find in the cache) the tiny warm-started model and print its path and accuracies.

    python tools/build_tiny_model.py                      # the default spec the demo uses
    python tools/build_tiny_model.py --steps 300 --target-probability none

The model is cached under $ASYNCRL_CACHE (default ~/.cache/asyncrl), keyed by the spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model
from asyncrl.tiny.task import TinyTaskSpec


def parse_spec(argv: list[str] | None = None) -> tuple[TinyModelSpec, str | None]:
    """Command-line options over the default spec; unset options keep the defaults."""
    defaults, task_defaults = TinyModelSpec(), TinyTaskSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--heads", type=int, default=defaults.num_heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.num_kv_heads)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--steps", type=int, default=defaults.warm_start_steps, help="warm-start steps")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument(
        "--target-probability", default=str(defaults.target_answer_probability),
        help="exact T=1 probability of the right answer to soften the trained model to, or 'none'",
    )
    parser.add_argument("--max-operand", type=int, default=task_defaults.max_operand)
    parser.add_argument("--ops", default=task_defaults.ops, help="operators, any of '+-*'")
    parser.add_argument("--cache-dir", default=None, help="default: $ASYNCRL_CACHE or ~/.cache/asyncrl")
    args = parser.parse_args(argv)
    target = None if args.target_probability.lower() == "none" else float(args.target_probability)
    spec = dataclasses.replace(
        defaults, seed=args.seed, num_layers=args.layers, hidden_size=args.hidden_size, num_heads=args.heads,
        num_kv_heads=args.kv_heads, intermediate_size=args.intermediate_size, warm_start_steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, target_answer_probability=target,
        task=dataclasses.replace(task_defaults, max_operand=args.max_operand, ops=args.ops),
    )
    return spec, args.cache_dir


def main(argv: list[str] | None = None) -> None:
    spec, cache_dir = parse_spec(argv)
    path = ensure_tiny_model(spec, cache_dir=cache_dir)
    report = json.loads((path / "warm_start.json").read_text())
    print(path)
    for split in ("eval", "train"):
        print(
            f"{split}: sampled (T=1) accuracy {report[f'{split}_sampled_accuracy']:.3f}, "
            f"greedy accuracy {report[f'{split}_greedy_accuracy']:.3f} on {report['num_prompts']} prompts"
        )
    print(f"warm start: {report['steps']} steps in {report['train_seconds']:.1f}s, softening temperature "
          f"{report.get('softening_temperature', 1.0):.2f}")


if __name__ == "__main__":
    main()
