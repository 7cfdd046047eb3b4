"""The token entropy of SFT checkpoints on the RL prompts, to choose the one to start RL from
(`asyncrl choose-checkpoint`; the rule is entropy_band.py).

For each checkpoint (a Hugging Face model directory), n responses to each of the first
num_prompts RL prompts (the config's training data, or `data`) are sampled as the run's first
rollouts would sample them (the first stage's temperature and max_tokens, one vLLM engine for all
checkpoints, weights pushed in over the run's weight sync) and scored by the run's verifiers. The
entropy is then computed as the learner's entropy/learner is: the mean over the response tokens of
the full-vocabulary entropy at the sampling temperature, from a transformers forward
(token_entropy.py); beside it the table shows the samples' mean -log pi (the estimate
`entropy/behaviour_sampled` logs), their mean reward and the largest gap between vLLM's and
transformers' logprob of a sampled token (small: the engine held that checkpoint).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.lab.offline.entropy_band import CheckpointEntropy


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def measure_checkpoints(checkpoints: list[str], num_prompts: int = 64, n: int = 4, config: str | None = None,
                              data: str | None = None, temperature: float | None = None,
                              max_tokens: int | None = None, engine: Any = None) -> list[CheckpointEntropy]:
    """Every checkpoint's CheckpointEntropy, in the order given (`engine`: a started
    PolicyEngine to use and leave running)."""
    import functools

    from asyncrl.data.build import load_records
    from asyncrl.data.stages import resolve_stages
    from asyncrl.lab.offline.eval_policy import load_run_config, reward_pool, sample_and_score
    from asyncrl.lab.offline.policy_engine import PolicyEngine
    from asyncrl.lab.offline.token_entropy import load_policy, response_entropy
    from asyncrl.reward.registry import route
    from asyncrl.rollout.engine import SamplingSpec

    if n < 1 or num_prompts < 1:
        raise ConfigError(f"--n and --num-prompts must be at least 1, got {n} and {num_prompts}")
    configs = [load_run_config(str(Path(c)), config, say)[0] for c in checkpoints]
    cfg = configs[0]
    records = load_records(cfg.data, functools.partial(route, cfg.reward), path=data)[:num_prompts]
    stage = resolve_stages(cfg)[0]
    spec = SamplingSpec(temperature or stage.temperature, cfg.rollout.top_p, max_tokens or stage.max_tokens,
                        seed=cfg.seed)
    say(f"{len(checkpoints)} checkpoints: {len(records)} prompts x {n} responses at T={spec.temperature}")
    own = engine is None
    engine = engine or PolicyEngine(cfg, say)
    pool = reward_pool(cfg, records)
    out = []
    try:
        for path, ckpt_cfg in zip(checkpoints, configs):
            await engine.load(ckpt_cfg.model.path)
            # The same seeds for every checkpoint: their differences are not sampling noise.
            samples = await sample_and_score(ckpt_cfg, records, n, spec, say, engine, pool)
            stats = response_entropy(load_policy(ckpt_cfg.model.path), samples, spec.temperature)
            out.append(CheckpointEntropy(path, stats.mean_entropy, stats.mean_nll,
                                         sum(s.reward for s in samples) / len(samples), stats.num_tokens,
                                         stats.max_logprob_gap))
    finally:
        pool.close()
        if own:
            await engine.shutdown()
    return out


def entropy_table(measured: list[CheckpointEntropy]) -> str:
    width = max(len("checkpoint"), *(len(m.path) for m in measured))
    lines = [f"{'checkpoint':<{width}}  entropy  sampled -log pi  reward  tokens  logprob gap"]
    lines += [f"{m.path:<{width}}  {m.entropy:7.4f}  {m.sampled_entropy:15.4f}  {m.accuracy:6.3f}  "
              f"{m.num_tokens:6d}  {m.logprob_gap:11.2e}" for m in measured]
    return "\n".join(lines)
