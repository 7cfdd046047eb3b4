"""What the per-step off-policy decomposition (`offpolicy/` metrics, learner.offpolicy_metrics)
costs the learner: one demo-sized step (the built-in tiny model, Phi = 512 loss tokens of
demo-length responses, staleness 0-2) through `forward_backward`, with the decomposition and
without it (the baseline), alternating in rounds.

    python tools/bench_offpolicy_metrics.py            # 20 rounds
    python tools/bench_offpolicy_metrics.py --rounds 50

Prints the median step time of each side and their ratio; run it with nothing else running.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--tokens", type=int, default=512, help="loss tokens a step (the demo's Phi)")
    args = p.parse_args()

    from asyncrl.compat import hide_broken_torch_extras

    hide_broken_torch_extras()  # before transformers' model classes import torchvision
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.algo.aggregation import StepCounts
    from asyncrl.config import load_config
    from asyncrl.learner.collate import collate
    from asyncrl.learner.model_forward import policy_forward
    from asyncrl.learner.policy_step import forward_backward
    from asyncrl.orchestrator.components import resolve_model_path
    from asyncrl.types import SequenceChunk

    torch.set_num_threads(1)  # the demo's learner.num_threads
    cfg = load_config(None, [])
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg, log=lambda s: None), dtype=torch.float32)
    rng = random.Random(0)
    chunks, total = [], 0
    while total < args.tokens:  # demo-like: 8-token prompts, responses of 4-16 tokens
        n = min(rng.randint(4, cfg.rollout.max_tokens), args.tokens - total)
        v = rng.choice([3, 3, 2, 1])
        chunks.append(SequenceChunk(f"g{len(chunks)}", 0, [rng.randint(3, 90) for _ in range(8)],
                                    [rng.randint(3, 90) for _ in range(n)], 0, [-rng.random() for _ in range(n)],
                                    [v] * n, rng.uniform(-1, 1), response_length=n))
        total += n
    mb = collate(chunks)
    counts = StepCounts.from_sequence_lengths([c.num_loss_tokens for c in chunks], token_budget=args.tokens)

    def forward(m):
        return policy_forward(model, m, cfg.learner.entropy_chunk_tokens, torch.device("cpu"))

    def step(version):
        model.zero_grad()
        t0 = time.perf_counter()
        forward_backward(forward, [mb], cfg.algo, counts, version=version, max_response_tokens=cfg.rollout.max_tokens)
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up
        step(None), step(3)
    times = {"without": [], "with": []}
    for r in range(args.rounds):
        for side in (("without", "with") if r % 2 == 0 else ("with", "without")):
            times[side].append(step(3 if side == "with" else None))
    base, new = (statistics.median(times[s]) for s in ("without", "with"))
    print(f"learner step of {args.tokens} loss tokens, median of {args.rounds} rounds: "
          f"without the decomposition {base * 1e3:.1f} ms, with it {new * 1e3:.1f} ms "
          f"(with / without = {new / base:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
