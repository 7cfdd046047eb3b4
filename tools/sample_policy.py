"""Load a policy (a run's `final/` directory, or any HF model dir) in vLLM and sample from it.

    python tools/sample_policy.py --model runs/tiny-cpu/final --num 64

Prompts come from the tiny task's held-out split; prints a few completions and the accuracy
(math-verify reward) at the given temperature. `--json` prints one machine-readable line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os


async def sample(model: str, num: int, temperature: float, max_tokens: int, seed: int) -> dict:
    from asyncrl.compat import hide_broken_torch_extras

    hide_broken_torch_extras()
    from transformers import AutoTokenizer

    from asyncrl.reward.math_reward import MathReward
    from asyncrl.rollout.engine import SamplingSpec
    from asyncrl.rollout.vllm_engine import VLLMEngine
    from asyncrl.tiny.task import make_problems

    tok = AutoTokenizer.from_pretrained(model)
    engine = VLLMEngine(model, max_model_len=64, seed=seed)
    await engine.start()
    try:
        records = make_problems(num, seed=seed, split="eval")
        spec = SamplingSpec(temperature, 1.0, max_tokens, seed=seed)
        outs = await asyncio.gather(*[
            engine.generate(tok.encode(r["prompt"], add_special_tokens=False), spec, f"s{i}")
            for i, r in enumerate(records)])
    finally:
        await engine.shutdown()
    reward = MathReward()
    texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    scores = [reward(t, r)[0] for t, r in zip(texts, records)]
    return {
        "model": model, "num_samples": num, "temperature": temperature,
        "accuracy": sum(scores) / num,
        "mean_response_tokens": sum(len(o.token_ids) for o in outs) / num,
        "examples": [f"{r['prompt']}{t}" for r, t in zip(records[:5], texts[:5])],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line only")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = asyncio.run(sample(args.model, args.num, args.temperature, args.max_tokens, args.seed))
    if args.json:
        print(json.dumps(result))
        return
    for ex in result["examples"]:
        print("  ", ex)
    print(f"accuracy at T={args.temperature}: {result['accuracy']:.3f} over {args.num} held-out prompts")


if __name__ == "__main__":
    main()
