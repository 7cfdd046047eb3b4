"""Packed micro-batches (learner/collate.py): the sequences back to back in one row with restarting
position ids give every loss token the logprob, entropy and gradient the padded layout gives, in
float64, on Hugging Face models of the two families the recipes use, with SDPA and eager attention;
and they carry no padding."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from asyncrl.learner.collate import collate
from asyncrl.learner.model_forward import packing_is_exact, policy_forward
from asyncrl.learner.packed_attention import NAME, packed_sdpa, sequence_starts, use_packed_attention
from asyncrl.types import SequenceChunk

CPU = torch.device("cpu")


def model_of(family, attention):
    """`attention`: a Hugging Face implementation, or packed_sdpa (learner/packed_attention.py) as
    the learner switches an SDPA model to it."""
    torch.manual_seed(0)
    shape = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128,
                 attn_implementation="sdpa" if attention == "packed_sdpa" else attention)
    config = LlamaConfig(**shape) if family == "llama" else Qwen2Config(**shape, tie_word_embeddings=True)
    model = (LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM)(config).double()
    if attention == "packed_sdpa":
        assert use_packed_attention(model)
    return model


def chunks():
    """RL-like: prompts and responses of different lengths, a continuation chunk (loss_start > 0)
    and an episode whose observation tokens are masked out of the loss."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (p, r, start) in enumerate([(4, 11, 0), (7, 3, 0), (2, 17, 5), (5, 8, 0)]):
        ids = torch.randint(1, 50, (p + r,), generator=g).tolist()
        n = r - start
        mask = [1, 1, 0, 0, 1, 1, 1, 1] if i == 3 else None
        out.append(SequenceChunk(f"g{i}", 0, ids[:p], ids[p:], start, (-torch.rand(n, generator=g)).tolist(),
                                 [0] * n, advantage=0.5 - i / 4, loss_mask=mask))
    return out


def test_the_packed_layout_is_one_row_without_padding_whose_columns_predict_the_targets():
    cs = chunks()
    packed, padded = collate(cs, packed=True), collate(cs)
    total = sum(c.num_tokens for c in cs)
    assert packed.input_ids.shape == (1, total) and packed.num_input_tokens == total
    assert padded.num_input_tokens == len(cs) * max(c.num_tokens for c in cs) > total
    assert packed.position_ids[0].tolist() == [i for c in cs for i in range(c.num_tokens)]
    # the logit at column j predicts the token at j + 1, in both layouts the same targets
    assert torch.equal(packed.input_ids[packed.rows, packed.cols + 1], packed.targets)
    assert torch.equal(padded.input_ids[padded.rows, padded.cols + 1], padded.targets)
    assert torch.equal(packed.targets, padded.targets) and packed.spans == padded.spans
    assert packed.num_loss_tokens == sum(c.num_loss_tokens for c in cs) == 34 - 2  # two observation tokens
    assert set(packed.model_inputs(CPU)) == {"input_ids", "position_ids", "use_cache"}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager", "packed_sdpa"])
def test_packed_and_padded_give_the_same_logprobs_entropies_and_gradients_in_float64(family, attention):
    model = model_of(family, attention)
    results = []
    for packed in (False, True):
        model.zero_grad()
        out = policy_forward(model, collate(chunks(), packed=packed), 7, CPU)
        (out.logprobs * torch.linspace(-1, 1, out.logprobs.numel(), dtype=torch.float64)).sum().backward()
        results.append((out.logprobs.detach(), out.entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp0, h0, g0), (lp1, h1, g1) = results
    assert lp0.dtype == torch.float64 and lp0.numel() == 32
    # Hugging Face's eager attention takes its softmax in float32 whatever the model's dtype, so its
    # two layouts agree to float32 rounding (seen: 4e-9 on a gradient, in some thread layouts)
    atol, rtol = (1e-7, 1e-6) if attention == "eager" else (1e-12, 1e-10)
    torch.testing.assert_close(lp1, lp0, atol=atol, rtol=0)
    torch.testing.assert_close(h1, h0, atol=atol, rtol=0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def test_packed_sdpa_runs_each_sequence_alone_and_leaves_other_calls_to_sdpa(monkeypatch):
    starts = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert sequence_starts(starts, 1) == [0, 3, 5]
    assert sequence_starts(torch.arange(9)[None], 1) is None          # one sequence: plain causal SDPA
    assert sequence_starts(starts.expand(2, -1), 2) is None            # a padded batch of rows
    assert sequence_starts(starts, 1, sliding_window=4) is None        # a window needs the mask
    assert sequence_starts(None, 1) is None
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counted(q, *args, **kwargs):
        calls.append(q.shape[2])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 9, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    module = torch.nn.Module()
    out, _ = packed_sdpa(module, q, k, v, None, scaling=0.5, position_ids=starts)
    assert calls == [3, 2, 4] and out.shape == (1, 9, 4, 8)
    # the second sequence's rows, computed alone with causal SDPA (its KV heads repeated by hand)
    alone = real(q[:, :, 3:5], k[:, :, 3:5].repeat_interleave(2, 1), v[:, :, 3:5].repeat_interleave(2, 1),
                 is_causal=True, scale=0.5)
    torch.testing.assert_close(out[:, 3:5], alone.transpose(1, 2), atol=1e-14, rtol=0)


def test_only_sdpa_models_are_switched_to_packed_sdpa():
    assert model_of("qwen2", "packed_sdpa").config._attn_implementation == NAME
    eager = model_of("llama", "eager")
    assert not use_packed_attention(eager) and eager.config._attn_implementation == "eager"


class MixesSequences(torch.nn.Module):
    """A model whose attention ignores position ids: packed, each sequence sees the ones before it."""

    def __init__(self):
        super().__init__()
        self.inner = model_of("llama", "sdpa")
        self.config = self.inner.config

    def forward(self, input_ids, position_ids=None, attention_mask=None, **kwargs):
        return self.inner(input_ids=input_ids, attention_mask=torch.ones_like(input_ids) if attention_mask is None
                          else attention_mask, **kwargs)

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


def test_the_start_check_passes_real_models_and_catches_one_that_mixes_packed_sequences():
    assert packing_is_exact(model_of("qwen2", "sdpa").float(), CPU)
    assert packing_is_exact(model_of("qwen2", "packed_sdpa").float(), CPU)
    assert packing_is_exact(model_of("llama", "eager").float(), CPU)
    assert not packing_is_exact(MixesSequences().float(), CPU)


def test_decoder_layer_checkpointing_keeps_the_gradient_in_float64():
    """learner.activation_checkpointing (Hugging Face's gradient checkpointing, non-reentrant, as
    rank.py enables it): each layer recomputed in backward gives the same gradient."""
    grads = []
    for checkpointing in (False, True):
        model = model_of("qwen2", "sdpa").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out = policy_forward(model, collate(chunks(), packed=True), 7, CPU)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert model.is_gradient_checkpointing
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)


def test_the_start_check_runs_without_dropout_and_leaves_the_model_training():
    model = model_of("llama", "packed_sdpa").float().train()
    model.config.attention_dropout = 0.5  # read at each forward: in training, two forwards would differ
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    assert packing_is_exact(model, CPU) and model.training
