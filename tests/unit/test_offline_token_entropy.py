"""The learner-side entropy of sampled responses (asyncrl/lab/offline/token_entropy.py) against a
float64 softmax of a tiny random transformers model's full logits, computed here by hand."""

import math
from types import SimpleNamespace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.lab.offline.token_entropy import response_entropy


def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def by_hand(model, prompt: list[int], response: list[int], temperature: float) -> tuple[list[float], list[float]]:
    """Per response token: (entropy, logprob) from the full float64 softmax of logits / T."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].double() / temperature
    logp = logits.log_softmax(-1)
    rows = range(len(prompt) - 1, len(prompt) + len(response) - 1)
    entropy = [-(logp[t].exp() * logp[t]).sum().item() for t in rows]
    chosen = [logp[t, tok].item() for t, tok in zip(rows, response)]
    return entropy, chosen


def test_token_mean_entropy_and_logprob_gap_match_a_full_softmax():
    model, temperature = tiny_model(), 0.7
    shapes = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9]), ([2, 2], [])]  # an empty response counts nothing
    samples, entropies, nll = [], [], []
    for i, (prompt, response) in enumerate(shapes):
        h, lp = by_hand(model, prompt, response, temperature)
        entropies += h
        reported = [x + 0.01 * (i + 1) for x in lp]  # the engine's logprobs, off by 0.01 and 0.02
        nll += [-x for x in reported]
        samples.append(SimpleNamespace(prompt_ids=prompt, token_ids=response, logprobs=reported))
    stats = response_entropy(model, samples, temperature, chunk=2)
    assert stats.num_tokens == 5
    assert math.isclose(stats.mean_entropy, sum(entropies) / 5, abs_tol=1e-6)
    assert math.isclose(stats.mean_nll, sum(nll) / 5, abs_tol=1e-9)
    assert math.isclose(stats.max_logprob_gap, 0.02, abs_tol=1e-6)
    assert 0 < stats.mean_entropy < math.log(11)
