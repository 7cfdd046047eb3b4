"""The bf16 rounding floor of the parity probe (learner/parity.py), against float64 by hand."""

from types import SimpleNamespace

import torch

from asyncrl.learner.parity import bf16_gaps

V = 7


class OneHotLM(torch.nn.Module):
    """logits[t] = W[:, id_t]: a one-hot input makes the matmul exact in any dtype, so under bf16
    autocast the logits are W's column rounded to bf16 and nothing else."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(V, V, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 3)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.head(torch.nn.functional.one_hot(input_ids, V).float()))


def test_gaps_are_the_bf16_rounding_of_the_logits_hand_computed_in_float64():
    model, seqs = OneHotLM(), [[0, 3, 5, 1], [2, 6]]
    w = model.head.weight.detach().double()
    w16 = model.head.weight.detach().bfloat16().double()
    want = []
    for ids in seqs:
        for prev, nxt in zip(ids, ids[1:]):
            exact = torch.log_softmax(w[:, prev], 0)[nxt]
            rounded = torch.log_softmax(w16[:, prev], 0)[nxt]
            want.append(abs(float(rounded - exact)))
    got = bf16_gaps(model, seqs, torch.device("cpu"))
    assert got["tokens"] == 4
    # float64 log-softmax of the same logits, in another layout: equal to float64 rounding
    assert abs(got["max_abs"] - max(want)) < 1e-12 and got["max_abs"] > 1e-4  # bf16's 8 bits show at logits ~3
    assert abs(got["mean_abs"] - sum(want) / 4) < 1e-12
