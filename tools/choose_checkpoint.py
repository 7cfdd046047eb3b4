"""Choose the SFT checkpoint to start RL from by its token entropy on the RL prompts.

    python tools/choose_checkpoint.py sft/epoch1 sft/epoch3 sft/epoch5 --config my.yaml --band 0.3 0.5
    python tools/choose_checkpoint.py a b c --band 0.2 0.6 --prefer lowest --num-prompts 128 --n 4

For each checkpoint (a Hugging Face model directory), --n responses to each of the first
--num-prompts RL prompts (the config's training data, or --data) are sampled as the run's first
rollouts would sample them (the first stage's temperature and max_tokens, one vLLM engine for all
checkpoints, weights pushed in over the run's weight sync) and scored by the run's verifiers.
The entropy is then computed as the learner's entropy/learner is: the mean over the response
tokens of the full-vocabulary entropy at the sampling temperature, from a transformers forward
(asyncrl/offline/token_entropy.py); beside it the table shows the samples' mean -log pi (the
estimate `entropy/behaviour_sampled` logs), their mean reward and the largest gap between vLLM's
and transformers' logprob of a sampled token (small: the engine held that checkpoint).

The rule and what Ring-lite and Skywork-OR1 did are in asyncrl/offline/entropy_band.py: the
checkpoint whose entropy is inside --band LOW HIGH, by --prefer among several. Prints the table
and the choice (its path alone on the last line of stdout). Exit codes: 0 chosen, 1 none in the
band (the error says which side each fell on), 2 bad arguments, config or data.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def measure(args: argparse.Namespace, engine: Any = None) -> list:
    """Every checkpoint's CheckpointEntropy, in the order given."""
    import functools

    from asyncrl.config import ConfigError
    from asyncrl.data.build import load_records
    from asyncrl.data.stages import resolve_stages
    from asyncrl.eval_policy import load_run_config, reward_pool, sample_and_score
    from asyncrl.offline.entropy_band import CheckpointEntropy
    from asyncrl.offline.policy_engine import PolicyEngine
    from asyncrl.offline.token_entropy import load_policy, response_entropy
    from asyncrl.reward.registry import route
    from asyncrl.rollout.engine import SamplingSpec

    if args.n < 1 or args.num_prompts < 1:
        raise ConfigError(f"--n and --num-prompts must be at least 1, got {args.n} and {args.num_prompts}")
    configs = [load_run_config(str(Path(c)), args.config, say)[0] for c in args.checkpoints]
    cfg = configs[0]
    records = load_records(cfg.data, functools.partial(route, cfg.reward), path=args.data)[:args.num_prompts]
    stage = resolve_stages(cfg)[0]
    spec = SamplingSpec(args.temperature or stage.temperature, cfg.rollout.top_p,
                        args.max_tokens or stage.max_tokens, seed=cfg.seed)
    say(f"{len(args.checkpoints)} checkpoints: {len(records)} prompts x {args.n} responses at T={spec.temperature}")
    own = engine is None
    engine = engine or PolicyEngine(cfg, say)
    pool = reward_pool(cfg, records)
    out = []
    try:
        for path, ckpt_cfg in zip(args.checkpoints, configs):
            await engine.load(ckpt_cfg.model.path)
            # The same seeds for every checkpoint: their differences are not sampling noise.
            samples = await sample_and_score(ckpt_cfg, records, args.n, spec, say, engine, pool)
            stats = response_entropy(load_policy(ckpt_cfg.model.path), samples, spec.temperature)
            out.append(CheckpointEntropy(path, stats.mean_entropy, stats.mean_nll,
                                         sum(s.reward for s in samples) / len(samples), stats.num_tokens,
                                         stats.max_logprob_gap))
    finally:
        pool.close()
        if own:
            await engine.shutdown()
    return out


def table(measured: list) -> str:
    width = max(len("checkpoint"), *(len(m.path) for m in measured))
    lines = [f"{'checkpoint':<{width}}  entropy  sampled -log pi  reward  tokens  logprob gap"]
    lines += [f"{m.path:<{width}}  {m.entropy:7.4f}  {m.sampled_entropy:15.4f}  {m.accuracy:6.3f}  "
              f"{m.num_tokens:6d}  {m.logprob_gap:11.2e}" for m in measured]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.config import ConfigError
    from asyncrl.offline.entropy_band import NoneInBand, choose

    hide_broken_torch_extras()  # before transformers and vLLM load
    try:
        if not args.band[0] < args.band[1]:
            raise ConfigError(f"--band: LOW must be below HIGH, got {args.band}")
        measured = asyncio.run(measure(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(measured))
    try:
        chosen = choose(measured, *args.band, prefer=args.prefer)
    except NoneInBand as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"chosen ({args.prefer} of the band [{args.band[0]:g}, {args.band[1]:g}]): entropy {chosen.entropy:.4f}")
    print(chosen.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
