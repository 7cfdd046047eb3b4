"""The hidden-state variant of the logprob/entropy computation: values, gradients, peak memory.

How peak memory is measured on CPU: tracemalloc only sees Python's allocator, not torch's;
ru_maxrss is a process-wide high-water mark that never goes down and includes whatever the
allocator and earlier tests left behind; torch has no CPU twin of cuda.max_memory_allocated; the
profiler's memory events attribute allocations to ops and frees separately, which makes a peak
fragile to reconstruct. `LiveTensorBytes` instead is a TorchDispatchMode: it sees the output of
every aten op run under it (forward, backward and checkpoint recomputation alike, since autograd
carries the mode into backward), records each new storage's size, and a weakref finalizer on that
storage subtracts it when torch frees it. The result is the exact peak of bytes held by tensors
created inside the block, independent of allocator caching and of the rest of the process.
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from asyncrl.algo.token_stats import token_logprobs_and_entropy, token_logprobs_and_entropy_from_hidden

F64 = torch.float64


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def _freed(self, key):
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._freed, key)
        return out


def _reference(hidden, weight, bias, targets, temperature):
    logits = (hidden @ weight.T + bias) / temperature
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _inputs(T=7, H=5, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, dtype=F64, generator=g), torch.randn(V, H, dtype=F64, generator=g),
            torch.randn(V, dtype=F64, generator=g), torch.randint(0, V, (T,), generator=g))


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_values_match_direct_float64_computation(chunk):
    hidden, weight, bias, targets = _inputs()
    logp, ent = token_logprobs_and_entropy_from_hidden(hidden, weight, targets, 0.7, chunk, bias)
    ref_logp, ref_ent = _reference(hidden, weight, bias, targets, 0.7)
    assert logp.dtype == F64
    assert torch.allclose(logp, ref_logp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    # and the logits-based variant agrees within float32 precision
    logits = hidden @ weight.T + bias
    logp32, ent32 = token_logprobs_and_entropy(logits, targets, 0.7, chunk)
    assert torch.allclose(logp32.double(), ref_logp, atol=1e-5) and torch.allclose(ent32.double(), ref_ent, atol=1e-5)


def test_gradients_match_direct_computation():
    hidden, weight, bias, targets = _inputs(T=9)
    coef = torch.linspace(-1, 1, 9, dtype=F64)
    grads = []
    for fn in ("chunked", "direct"):
        h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
        if fn == "chunked":
            logp, ent = token_logprobs_and_entropy_from_hidden(h, w, targets, 1.3, 2, b)
        else:
            logp, ent = _reference(h, w, b, targets, 1.3)
        ((coef * logp).sum() - 0.1 * ent.sum()).backward()
        grads.append((h.grad, w.grad, b.grad))
    for ours, ref in zip(*grads):
        assert torch.allclose(ours, ref, atol=1e-12)


def test_float32_inputs_within_1e_6_of_float64_and_empty_input():
    hidden, weight, bias, targets = _inputs(T=16, H=8, V=50)
    logp, ent = token_logprobs_and_entropy_from_hidden(hidden.float(), weight.float(), targets, 1.0, 5)
    ref_logp, ref_ent = _reference(hidden.float().double(), weight.float().double(), 0.0, targets, 1.0)
    assert logp.dtype == torch.float32
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-6 * 50)
    logp, ent = token_logprobs_and_entropy_from_hidden(hidden[:0], weight, targets[:0])
    assert logp.shape == ent.shape == (0,)
    with pytest.raises(ValueError):
        token_logprobs_and_entropy_from_hidden(hidden, weight, targets[:3])
    with pytest.raises(ValueError):
        token_logprobs_and_entropy_from_hidden(hidden, weight[:, :2], targets)


def test_peak_memory_is_lower_and_no_full_logits_tensor_exists():
    T, H, V, chunk = 256, 8, 2048, 16
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    bias = torch.zeros(V)
    targets = torch.randint(0, V, (T,), generator=g)
    full_logits_bytes = T * V * 4

    def run(fn):
        hidden.grad = weight.grad = None
        meter = LiveTensorBytes()
        with meter:
            logp, ent = fn()
            (logp.sum() + ent.sum()).backward()
        return meter.peak, logp.detach(), ent.detach(), weight.grad.clone()

    direct = run(lambda: _reference(hidden, weight, bias, targets, 1.0))
    chunked = run(lambda: token_logprobs_and_entropy_from_hidden(hidden, weight, targets, 1.0, chunk))
    assert direct[0] >= 3 * full_logits_bytes  # the meter sees the [T, V] tensors, backward included
    assert chunked[0] < full_logits_bytes / 2  # so no [T, V] tensor ever existed
    assert chunked[0] < direct[0] / 8
    assert torch.allclose(chunked[1], direct[1], atol=1e-5) and torch.allclose(chunked[2], direct[2], atol=1e-4)
    assert torch.allclose(chunked[3], direct[3], atol=1e-4)
