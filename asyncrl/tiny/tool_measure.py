"""How well a tiny model uses the calculator (tool_task.py): the warm start's stopping rule and the
build's report, sampled the way the RL episodes are (temperature 1 over the whole vocabulary, the
calculator answering each call that ends a turn).

Sampling runs every prompt of a batch in lock step (all prompts of the task are 6 characters):
at each position a row either samples its next token or, while the calculator's answer is being
read in, is fed that answer's next token, so one forward per position serves the whole batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from asyncrl.env.base import Turn
from asyncrl.env.calculator import Calculator
from asyncrl.tiny import task as tiny_task
from asyncrl.tiny import tool_task
from asyncrl.tiny.measure import pad_rows


@dataclass
class Episode:
    text: str
    calls: list[str]
    correct: bool
    """The boxed answer is the product."""
    good_call: bool
    """A call asked for exactly the prompt's product (so its result was the answer)."""


def encode_traces(records: list[dict[str, str]], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [N, L] and labels [N, L] of the tool-using traces of `records`."""
    return pad_rows([tool_task.encode_trace(*operands(r), tokenizer) for r in records], tokenizer.pad_token_id)


def operands(record: dict[str, str]) -> tuple[int, int]:
    a, b = record["prompt"].rstrip("=").split("*")
    return int(a), int(b)


@torch.no_grad()
def sample_episodes(model, tokenizer, records: list[dict[str, str]], gen: torch.Generator,
                    greedy: bool = False, max_new_tokens: int = 56) -> list[Episode]:
    prompts = torch.tensor([tokenizer.encode(r["prompt"]) for r in records])
    n, eos = len(records), tokenizer.eos_token_id
    rows: list[list[int]] = [[] for _ in range(n)]
    feed: list[deque[int]] = [deque() for _ in range(n)]  # the calculator's answer, being read in
    turn, calls, done = [""] * n, [[] for _ in range(n)], [False] * n
    envs = [Calculator({}) for _ in range(n)]
    out = model(input_ids=prompts, use_cache=True)
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        tokens = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
        for i in range(n):
            if done[i]:
                tokens[i] = tokenizer.pad_token_id
                continue
            if feed[i]:
                tokens[i] = feed[i].popleft()
                rows[i].append(int(tokens[i]))
                continue
            token = int(tokens[i])
            rows[i].append(token)
            if token == eos:
                done[i] = True
                continue
            turn[i] += tokenizer.decode([token])
            if turn[i].endswith(Calculator.stop[0]):
                calls[i].append(turn[i])
                step = envs[i].step(Turn(len(calls[i]) - 1, turn[i], [], "stop"))
                done[i] = step.done
                feed[i].extend(tokenizer.encode(step.observation))
                turn[i] = ""
        if all(done):
            break
        out = model(input_ids=tokens[:, None], past_key_values=out.past_key_values, use_cache=True)
    episodes = []
    for r, row, made in zip(records, rows, calls):
        a, b = operands(r)
        text = tokenizer.decode(row, skip_special_tokens=True)
        episodes.append(Episode(text, made, tiny_task.extract_boxed(text) == r["answer"],
                                any(c.endswith(f"<calc>{a}*{b}</calc>") for c in made)))
    return episodes


def success(model, tokenizer, records: list[dict[str, str]], greedy: bool = False, seed: int = 0,
            batch: int = 512) -> dict[str, float]:
    """Accuracy (the boxed answer is right), tool-call rate and good-call rate over `records`."""
    gen = torch.Generator().manual_seed(seed)
    episodes = [e for lo in range(0, len(records), batch)
                for e in sample_episodes(model, tokenizer, records[lo:lo + batch], gen, greedy)]
    n = len(episodes)
    return {"accuracy": sum(e.correct for e in episodes) / n, "tool_call_rate": sum(bool(e.calls) for e in episodes) / n,
            "good_call_rate": sum(e.good_call for e in episodes) / n}


def evaluate(model, tokenizer, num_prompts: int, seed: int) -> dict[str, float]:
    """The build's report: sampled and greedy accuracy and tool use, held-out and train."""
    result: dict[str, float] = {"num_prompts": num_prompts}
    for split in ("eval", "train"):
        records = tool_task.make_problems(num_prompts, seed, split)
        for mode, greedy in (("sampled", False), ("greedy", True)):
            for key, value in success(model, tokenizer, records, greedy, seed).items():
                result[f"{split}_{mode}_{key}"] = value
    return result
