"""How well a tiny model does its task (the warm start stops on it), and the optional softening.

`measure_accuracy` samples the way RL rollouts do (plain temperature 1 over the whole vocabulary,
greedy as the other end): the warm start's stopping rule. `answer_probability` is the exact
probability of sampling the canonical right response at temperature 1 (sampled accuracy without
sampling noise, a few points lower: a stray character before the right ``\\boxed{}`` also counts
as correct when sampling); `soften` (an option of the build, off by default) bakes a temperature
into the weights to bring it down to a target.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from asyncrl.tiny import task as tiny_task

if TYPE_CHECKING:
    from asyncrl.tiny.spec import TinyModelSpec


def encode_examples(pairs: list[tuple[str, str]], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` [N, L] and ``labels`` [N, L] (-100 outside response + eos)
    for ``(prompt, response)`` pairs."""
    rows = []
    for prompt_text, response_text in pairs:
        prompt = tokenizer.encode(prompt_text)
        response = tokenizer.encode(response_text) + [tokenizer.eos_token_id]
        rows.append((prompt + response, [-100] * len(prompt) + response))
    return pad_rows(rows, tokenizer.pad_token_id)


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) rows right-padded into [N, L] tensors, labels with -100."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        labels[i, : len(row_labels)] = torch.tensor(row_labels)
    return ids, labels


@torch.no_grad()
def answer_probability(model, tokenizer, records: list[dict[str, str]]) -> float:
    """Mean exact probability of sampling the target response (up to its closing brace) at
    temperature 1: the sampled accuracy without sampling noise."""
    pairs = [(r["prompt"], tiny_task.format_response(r["answer"])) for r in records]
    ids, labels = encode_examples(pairs, tokenizer)
    logprobs = torch.log_softmax(model(input_ids=ids).logits[:, :-1], dim=-1)
    token_logprobs = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = (labels[:, 1:] != -100) & (labels[:, 1:] != tokenizer.eos_token_id)
    return (token_logprobs * mask).sum(dim=1).exp().mean().item()


@torch.no_grad()
def soften(model, tokenizer, records: list[dict[str, str]], target: float) -> float:
    """Divide the final norm's weight by tau so that answer_probability equals ``target``.

    With tied embeddings and no LM-head bias, logits are linear in that weight, so this is
    exactly temperature tau baked into the weights. Bisection on log tau in [0, log 100]
    (accuracy falls as tau grows). Returns tau (1.0 if the model is already below target).
    """
    norm, original = model.model.norm.weight, model.model.norm.weight.detach().clone()
    if answer_probability(model, tokenizer, records) <= target:
        return 1.0
    low, high = 0.0, math.log(100.0)
    for _ in range(30):
        mid = (low + high) / 2
        norm.copy_(original / math.exp(mid))
        low, high = (mid, high) if answer_probability(model, tokenizer, records) > target else (low, mid)
    tau = math.exp((low + high) / 2)
    norm.copy_(original / tau)
    return tau


@torch.no_grad()
def sample(model, prompt_ids: torch.Tensor, eos_id: int, greedy: bool, gen: torch.Generator, max_new_tokens: int = 16) -> list[list[int]]:
    """Complete equal-length prompts [B, P] greedily or by plain temperature-1 sampling over the
    whole vocabulary, as the RL rollouts sample: new tokens per row, up to and including eos.
    Not HF generate: it applies a default top-k of 50, which overstates sampled accuracy."""
    out = model(input_ids=prompt_ids, use_cache=True)
    done = torch.zeros(len(prompt_ids), dtype=torch.bool)
    rows: list[list[int]] = [[] for _ in range(len(prompt_ids))]
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        probs = torch.softmax(logits, -1)
        token = logits.argmax(-1) if greedy else torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        for i in (~done).nonzero().flatten().tolist():
            rows[i].append(token[i].item())
        done |= token == eos_id
        if done.all():
            break
        out = model(input_ids=token[:, None], past_key_values=out.past_key_values, use_cache=True)
    return rows


def measure_accuracy(model, tokenizer, records: list[dict[str, str]], greedy: bool, seed: int = 0) -> float:
    """Fraction of records with the right ``\\boxed{}`` answer, one completion each (prompts are
    grouped by length, so no padding)."""
    gen = torch.Generator().manual_seed(seed)
    by_length: dict[int, list[dict[str, str]]] = {}
    for rec in records:
        by_length.setdefault(len(tokenizer.encode(rec["prompt"])), []).append(rec)
    correct = 0
    for _, group in sorted(by_length.items()):
        prompts = torch.tensor([tokenizer.encode(rec["prompt"]) for rec in group])
        for rec, row in zip(group, sample(model, prompts, tokenizer.eos_token_id, greedy, gen)):
            correct += tiny_task.is_correct(tokenizer.decode(row, skip_special_tokens=True), rec["answer"])
    return correct / len(records)


def evaluate(model, tokenizer, spec: "TinyModelSpec") -> dict:
    """Sampled (T=1) and greedy accuracy, and the exact probability of the canonical right
    response (the sampled accuracy without sampling noise), on held-out and on train prompts."""
    result = {"num_prompts": spec.num_eval_prompts}
    for split in ("eval", "train"):
        records = tiny_task.make_problems(spec.num_eval_prompts, spec.seed, split, spec.task)
        result[f"{split}_sampled_accuracy"] = measure_accuracy(model, tokenizer, records, greedy=False, seed=spec.seed)
        result[f"{split}_greedy_accuracy"] = measure_accuracy(model, tokenizer, records, greedy=True)
        result[f"{split}_answer_probability"] = answer_probability(model, tokenizer, records)
    return result
