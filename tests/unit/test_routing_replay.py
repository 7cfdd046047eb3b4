"""Rollout routing replay (algo.moe_routing: replay): the gate-weight formula by hand in float64,
the learner's forward with recorded experts equal to a forward with them forced by an independent
router (packed or padded, whatever the micro-batch split), and the engine-side bookkeeping that
files a vLLM step's rows under their requests."""

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from asyncrl.algo.moe import replayed_routing, same_experts
from asyncrl.learner.collate import collate
from asyncrl.learner.model_forward import policy_forward
from asyncrl.learner.replay import install
from asyncrl.learner.routers import routers
from asyncrl.rollout.routes import NONE, RoutingCapture, merged, sample_routes
from asyncrl.types import SequenceChunk

LAYERS, EXPERTS, K, VOCAB = 2, 6, 2, 40


def test_replayed_gate_weights_are_the_router_probabilities_at_the_recorded_experts_renormalized():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.25], [1.0, 0.0, -0.5, 3.0]], dtype=torch.float64)
    own = torch.tensor([[2, 0], [3, 0]])
    recorded = torch.tensor([[1, 3], [-1, -1]])  # row 1: nothing recorded, its own choice stays
    weights, indices = replayed_routing(logits, own, recorded, norm_topk_prob=True)
    assert indices.tolist() == [[1, 3], [3, 0]]
    z0 = [math.exp(v) for v in (0.5, -1.0, 2.0, 0.25)]
    z1 = [math.exp(v) for v in (1.0, 0.0, -0.5, 3.0)]
    want = [[z0[1] / (z0[1] + z0[3]), z0[3] / (z0[1] + z0[3])], [z1[3] / (z1[3] + z1[0]), z1[0] / (z1[3] + z1[0])]]
    assert torch.allclose(weights, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    raw, _ = replayed_routing(logits, own, recorded, norm_topk_prob=False)  # the probabilities themselves
    assert raw[0].tolist() == pytest.approx([z0[1] / sum(z0), z0[3] / sum(z0)], abs=1e-15)
    # the gradient reaches the router's logits through the replayed experts' probabilities
    x = logits.clone().requires_grad_(True)
    replayed_routing(x, own, recorded, norm_topk_prob=False)[0][0, 0].backward()
    p = [v / sum(z0) for v in z0]
    assert x.grad[0].tolist() == pytest.approx([-p[1] * p[0], p[1] * (1 - p[1]), -p[1] * p[2], -p[1] * p[3]], abs=1e-15)
    assert same_experts(torch.tensor([[1, 3], [0, 2]]), torch.tensor([[3, 1], [0, 1]])).tolist() == [True, False]


def tiny_moe():
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=K,
        norm_topk_prob=True, max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[],
        experts_implementation="eager")).double().eval()


def random_routes(n: int, g: torch.Generator) -> bytes:
    """n positions of distinct random experts per layer, the last position unrecorded (as the engine's)."""
    rows = torch.stack([torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(LAYERS)])
                        for _ in range(n)]).to(torch.uint8)
    rows[-1] = NONE
    return rows.numpy().tobytes()


def chunks(g: torch.Generator) -> list[SequenceChunk]:
    out = []
    for i, (p, r, start) in enumerate([(3, 6, 0), (4, 3, 1), (2, 7, 2)]):
        prompt = torch.randint(1, VOCAB, (p,), generator=g).tolist()
        response = torch.randint(1, VOCAB, (r,), generator=g).tolist()
        out.append(SequenceChunk(f"g{i}", 0, prompt, response, start, [0.0] * (r - start), [0] * (r - start), 1.0,
                                 routed_experts=random_routes(p + r, g)))
    return out


def forced(model, chunk: SequenceChunk) -> torch.Tensor:
    """The loss tokens' logprobs from one sequence alone, every router replaced by one that returns
    the recorded experts with their renormalized softmax weights (its own top-k where none)."""
    rows = torch.from_numpy(np.frombuffer(chunk.routed_experts, np.uint8).reshape(-1, LAYERS, K).astype(np.int64))
    saved = []
    for layer, router in enumerate(routers(model)):
        def force(h, router=router, layer=layer):
            logits = F.linear(h.reshape(-1, router.hidden_dim), router.weight)
            probs = torch.softmax(logits, dim=-1)
            top = torch.topk(probs, K, dim=-1).indices
            chosen = torch.where(rows[:, layer] == NONE, top, rows[:, layer])
            w = probs.gather(-1, chosen)
            return logits, w / w.sum(-1, keepdim=True), chosen
        saved.append(router.forward)
        router.forward = force
    try:
        ids = torch.tensor([chunk.prompt_ids + chunk.response_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    finally:
        for router, f in zip(routers(model), saved):
            router.forward = f
    p = len(chunk.prompt_ids)
    return torch.stack([logp[p + j - 1, chunk.response_ids[j]] for j in range(chunk.loss_start, len(chunk.response_ids))])


@pytest.mark.parametrize("split", [[3], [1, 1, 1], [2, 1]])
@pytest.mark.parametrize("packed", [True, False])
def test_a_replayed_forward_equals_a_forward_with_the_recorded_experts_forced(split, packed):
    model = tiny_moe()
    cs = chunks(torch.Generator().manual_seed(3))
    want = torch.cat([forced(model, c) for c in cs])
    free = torch.cat([policy_forward(model, collate([c]), 64, torch.device("cpu")).logprobs for c in cs])
    assert (free - want).abs().max() > 1e-3  # the recorded experts are not the model's own
    install(model)
    got, counts, at = [], torch.zeros(4, dtype=torch.float64), 0
    for n in split:
        out = policy_forward(model, collate(cs[at:at + n], packed=packed), 64, torch.device("cpu"))
        got.append(out.logprobs)
        counts += out.routes
        at += n
    assert torch.allclose(torch.cat(got), want, rtol=0, atol=1e-12)
    positions = sum(c.num_tokens for c in cs)
    recorded, used, own, pairs = counts.tolist()
    assert (recorded, used, pairs) == ((positions - 3) * LAYERS, recorded, positions * LAYERS)
    assert own < recorded
    bare = policy_forward(model, collate([replace(cs[0], routed_experts=b"")]), 64, torch.device("cpu"))
    assert torch.allclose(bare.logprobs, free[:6], rtol=0, atol=1e-12)  # no routing: the routers' own, as before
    assert bare.routes is None


def test_collate_lays_routing_rows_out_as_the_inputs_flattened():
    g = torch.Generator().manual_seed(1)
    a, b = chunks(g)[:2]
    row = LAYERS * K
    for packed in (True, False):
        mb = collate([a, b], packed=packed)
        rows = mb.routed_experts
        assert rows.shape == (mb.input_ids.numel(), row) and rows.dtype == torch.uint8
        at_b = a.num_tokens if packed else mb.input_ids.shape[1]
        assert rows[:a.num_tokens].numpy().tobytes() == a.routed_experts
        assert rows[at_b:at_b + b.num_tokens].numpy().tobytes() == b.routed_experts
        assert (rows[a.num_tokens:at_b] == NONE).all()  # padding
    assert collate([SequenceChunk("h", 0, [1], [2], 0, [0.0], [0], 0.0)]).routed_experts is None


def test_a_sample_keeps_the_last_routing_of_each_position_and_pads_what_was_never_recorded():
    """A request resumed after an in-flight update's abort prefills its prefix again: the tokens it
    samples attended to that recomputed prefix, so its rows are the sample's."""
    first = np.array([[[1, 2]], [[3, 4]], [[5, 6]]], dtype=np.uint8)  # 3 positions, 1 layer, top-2
    resumed = np.array([[[7, 7]], [[7, 7]], [[0, 1]]], dtype=np.uint8)  # the prefix again (2 of it), 1 more
    routes = np.frombuffer(sample_routes([first, None, resumed], 6), np.uint8).reshape(6, 1, 2)
    assert routes[:, 0].tolist() == [[7, 7], [7, 7], [0, 1], [NONE, NONE], [NONE, NONE], [NONE, NONE]]
    longer = np.frombuffer(sample_routes([first, resumed[:1]], 3), np.uint8).reshape(3, 1, 2)
    assert longer[:, 0].tolist() == [[7, 7], [3, 4], [5, 6]]  # what the later request did not recompute stays
    assert sample_routes([None, np.zeros((0, 1, 2), np.uint8)], 6) == b""
    assert merged([(2, first[:1]), (0, first)], 1, 2)[:, 0].tolist() == [[1, 2], [3, 4], [5, 6]]


def scheduled(new=(), finished=()):
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=p, num_computed_tokens=c)
                                               for r, p, c in new], finished_req_ids=set(finished))


def test_the_engine_capture_files_each_steps_rows_under_their_requests():
    cap = RoutingCapture(num_layers=2, top_k=1, block_size=2)

    def forward(rows_per_layer):
        for layer, rows in enumerate(rows_per_layer):
            cap.capture(layer, torch.tensor(rows).view(-1, 1))

    # step 1: a's prompt (3 tokens) prefilled; b hits the prefix cache of nothing yet (0 computed)
    cap.start_step(scheduled(new=[("a-x1", [5, 6, 7], 0)]), ["a-x1"], np.array([0]), np.array([3]))
    forward([[1, 2, 3], [4, 5, 6]])
    # step 2: a decodes position 3; c has a's prompt and e another sharing its first block (of 2
    # tokens), both served from the cache, 1 token computed each
    cap.start_step(scheduled(new=[("c-x3", [5, 6, 7], 2), ("e-x5", [5, 6, 9], 2)]), ["a-x1", "c-x3", "e-x5"],
                   np.array([3, 2, 2]), np.array([1, 1, 1]))
    forward([[9, 8, 7], [0, 1, 2]])
    got = cap.take(["a", "c", "e", "unknown"])
    a, c, e = (np.frombuffer(got[r], np.uint8).reshape(-1, 2, 1)[:, :, 0].tolist() for r in "ace")
    assert a == [[1, 4], [2, 5], [3, 6], [9, 0]]
    assert c == [[1, 4], [2, 5], [8, 1]]  # its cached prefix from a's prefill
    assert e == [[1, 4], [2, 5], [7, 2]]
    assert got["unknown"] == b"" and cap.take(["a"]) == {"a": b""}  # forgotten once taken
    cap.forget_prefixes()
    cap.start_step(scheduled(new=[("d-x4", [5, 6, 7], 2)]), ["d-x4"], np.array([2]), np.array([1]))
    forward([[3], [3]])
    d = np.frombuffer(cap.take(["d"])["d"], np.uint8).reshape(-1, 2, 1)[:, :, 0].tolist()
    assert d == [[NONE, NONE], [NONE, NONE], [3, 3]]  # after a load: no old prefill to copy
    cap.capture(0, torch.tensor([[1]]))  # a forward outside any step (warm-up): ignored
    assert cap.segments == {}
