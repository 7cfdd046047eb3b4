"""Measure the bf16 rounding floor of the logprob-parity probe: how far a model's logprobs under
bf16 autocast are from its float32 ones, per token, on the model's own samples.

    python tools/parity_floor.py [--model DIR ...] [--agent] [--sequences 64] [--max-new-tokens 32]

The probe (sync.probe_every) scores one sample on the learner and on every engine and raises when
the largest per-token gap passes the tolerance. Each side that computes in bf16 rounds its logits
its own way, so the tolerance must allow each bf16 side's gap to float32, added up
(`Config.parity_tolerance`). This tool measures that gap: for each model, `--sequences` prompts of
the tiny task, a response sampled from the model in float32, and the whole sequence scored
teacher-forced in float32 and under bf16 autocast (asyncrl/learner/parity.py).

Models: the default tiny model, `--agent` adds the tiny agent's (built if missing: minutes), and
`--model` any local Hugging Face directory. The last line is JSON: per-model gaps, the largest
(`floor_bf16`) and the tolerance it gives two bf16 sides; compare with
asyncrl/config/sync_section.py's ROUNDING_FLOOR_NATS, which the default tolerances come from.
"""

from __future__ import annotations

import argparse
import json


def samples(model, tokenizer, prompts: list[str], max_new_tokens: int, seed: int) -> list[list[int]]:
    import torch

    torch.manual_seed(seed)
    out = []
    for text in prompts:
        ids = torch.tensor([tokenizer.encode(text)])
        seq = model.generate(ids, do_sample=True, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        out.append(seq[0].tolist())
    return out


def measure(path: str, num: int, max_new_tokens: int, seed: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.learner.parity import bf16_gaps
    from asyncrl.tiny.build import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [r["prompt"] for r in load_prompts(num, seed, "train")]
    return {"model": path, **bf16_gaps(model, samples(model, tokenizer, prompts, max_new_tokens, seed),
                                       torch.device("cpu"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=[], help="a Hugging Face model directory (repeatable)")
    p.add_argument("--agent", action="store_true", help="also the tiny agent's model (built if missing)")
    p.add_argument("--sequences", type=int, default=64, help="sampled sequences per model")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from asyncrl.compat import hide_broken_torch_extras

    hide_broken_torch_extras()
    from asyncrl.config.sync_section import ROUNDING_FLOOR_NATS
    from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model

    paths = list(args.model)
    if not paths:
        paths.append(str(ensure_tiny_model(TinyModelSpec())))
    if args.agent:
        paths.append(str(ensure_tiny_model(TinyModelSpec(tool=True))))
    rows = [measure(path, args.sequences, args.max_new_tokens, args.seed) for path in paths]
    print(f"\n{'tokens':>7} {'max':>8} {'p99':>8} {'mean':>8}  model (|log p_bf16 - log p_fp32| per token, nats)")
    for r in rows:
        print(f"{r['tokens']:>7} {r['max_abs']:>8.4f} {r['p99_abs']:>8.4f} {r['mean_abs']:>8.5f}  {r['model']}")
    floor = max(r["max_abs"] for r in rows)
    print(f"bf16 floor measured: {floor:.4f} nats (ROUNDING_FLOOR_NATS has {ROUNDING_FLOOR_NATS['bfloat16']}); "
          f"two bf16 sides: {2 * floor:.4f}")
    print(json.dumps({"models": rows, "floor_bf16": floor, "tolerance_bf16_both": 2 * floor,
                      "configured_floor_bf16": ROUNDING_FLOOR_NATS["bfloat16"]}))


if __name__ == "__main__":
    main()
