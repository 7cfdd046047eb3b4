"""The learner's algorithm machinery on real Hugging Face models, in-process (no Ray): the
hidden-state forward, MoE auxiliary losses, adaptive entropy control and reference resets.

Comparisons of two computations that sum in different orders (a fused path against a direct
one, one micro-batch against several) run in float64: in float32 their difference is set by the
processor's summation order (AVX-512 reduces in another order than AVX2), in float64 it is
~1e-16 relative, so tolerances of 1e-12 hold on any processor and still catch a real error."""

import math
import random
import shutil

import pytest
import torch

from asyncrl.algo.aggregation import StepCounts
from asyncrl.algo.moe import load_balance_loss, router_z_loss
from asyncrl.buffer.packing import rank_batches
from asyncrl.config import AlgoConfig, LearnerConfig
from asyncrl.learner.backend import MOMENTS
from asyncrl.learner.collate import collate
from asyncrl.learner.model_forward import policy_forward
from asyncrl.learner.policy_step import forward_backward
from asyncrl.learner.rank import LearnerRank
from asyncrl.transport.codec import encode_batch
from asyncrl.transport.zmq_stream import FrameSender
from asyncrl.types import Batch, ReferenceReset, SequenceChunk

VOCAB = 40


def qwen2(tie=True):
    """In float64 (see the module's docstring)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        tie_word_embeddings=tie)).double()


def qwen2_moe():
    """In float64; the experts' default kernel (grouped_mm) has no float64, the eager one does."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1))
    model.set_experts_implementation("eager")
    return model.double()


def make_chunks(seed=0, n=6, vocab=VOCAB):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, vocab) for _ in range(3 + i % 2)]
        resp = [rng.randrange(4, vocab) for _ in range(4 + i)]
        start = i % 2
        out.append(SequenceChunk(f"g{i}", 0, prompt, resp, start, [-3.0] * (len(resp) - start),
                                 [0] * (len(resp) - start), advantage=(-1.0) ** i))
    return out


@pytest.mark.parametrize("tie", [True, False])
def test_hidden_state_forward_equals_full_logits(tie):
    model = qwen2(tie)
    chunks = make_chunks()
    for i, c in enumerate(chunks):  # responses drawn at different temperatures (training stages)
        c.temperature = 0.7 if i % 2 else 1.3
    mb = collate(chunks)
    out = policy_forward(model, mb, chunk=5, device=torch.device("cpu"))
    assert out.logprobs.dtype == out.entropy.dtype == torch.float64  # float64 in, float64 out
    (out.logprobs.sum() + out.entropy.sum()).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # the direct path, written out in float64: the whole [T, V] logits, divided by each token's
    # temperature (the float32 temperatures, widened, as the fused path widens them)
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[mb.rows, mb.cols]
    logp_all = torch.log_softmax(logits / mb.temperatures[:, None].double(), dim=-1)
    logp = logp_all.gather(-1, mb.targets[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    (logp.sum() + ent.sum()).backward()
    # measured in float64: logprobs and entropies <= 9e-16 apart (|logp|, H < 5), gradients
    # <= 1.8e-15 (|grad| < 8): 1e-12 leaves a margin of 500 (in float32 they were 4.8e-7 and
    # 1.4e-6 apart, against the old 1e-6 and 1e-5)
    torch.testing.assert_close(out.logprobs, logp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out.entropy, ent, atol=1e-12, rtol=1e-12)
    for a, p in zip(got, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-12, rtol=1e-12)


def test_moe_aux_losses_are_added_with_their_coefficients():
    model = qwen2_moe()
    chunks = make_chunks()
    mb = collate(chunks)
    counts = StepCounts.from_sequence_lengths([c.num_loss_tokens for c in chunks], token_budget=64)
    algo = AlgoConfig(moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
    dev = torch.device("cpu")
    m = forward_backward(lambda b: policy_forward(model, b, 8, dev), [mb], algo, counts, moe_top_k=2)
    with torch.no_grad():
        out = policy_forward(model, mb, 8, dev)
        lb = float(load_balance_loss(out.router_logits, 2, mb.attention_mask))
        z = float(router_z_loss(out.router_logits, mb.attention_mask))
    # float64 (the step's sums and the direct means sum in different orders): measured 0 apart
    assert m["loss/moe_load_balance"] == pytest.approx(lb, rel=1e-12)
    assert m["loss/moe_z"] == pytest.approx(z, rel=1e-12)
    assert m["loss/total"] == pytest.approx(m["loss/policy"] + 0.01 * lb + 0.001 * z, rel=1e-12)
    assert 1.0 < lb < 4.0  # between perfectly balanced (k = 2) and everything on k experts (E = 4)


def test_moe_aux_losses_do_not_depend_on_micro_batching():
    """The load-balance loss E * sum f_e P_e and the z-loss are means over every routed token of
    the step: cutting the step into micro-batches changes neither their values nor their
    gradients (f, which has no gradient, is the whole step's). Both equal the whole batch's
    values computed directly from its router logits, as Hugging Face defines them."""
    model = qwen2_moe()
    chunks = make_chunks(n=8)
    counts = StepCounts.from_sequence_lengths([c.num_loss_tokens for c in chunks], token_budget=64)
    algo = AlgoConfig(moe_aux_loss_coef=0.5, moe_z_loss_coef=0.05)  # large, so their gradients show
    dev = torch.device("cpu")

    def run(mbs):
        model.zero_grad()
        m = forward_backward(lambda b: policy_forward(model, b, 8, dev), [collate(c) for c in mbs], algo, counts,
                             moe_top_k=2)
        return m, [p.grad.clone() for p in model.parameters()]

    whole, g_whole = run([chunks])
    with torch.no_grad():
        mb = collate(chunks)
        out = policy_forward(model, mb, 8, dev)
        lb = float(load_balance_loss(out.router_logits, 2, mb.attention_mask))
        z = float(router_z_loss(out.router_logits, mb.attention_mask))
    # float64: a split sums the same terms in another order. Measured: values <= 2.3e-16 apart
    # (relative), gradients <= 1.4e-17 (|grad| < 0.04); a split computed with its own f, or
    # dividing by its own count, is off by percents (in float32 the splits differed by 5e-8
    # relative and 6.5e-9 in the gradients, against the old 1e-6 and atol 1e-6 / rtol 1e-5)
    assert whole["loss/moe_load_balance"] == pytest.approx(lb, rel=1e-12)
    assert whole["loss/moe_z"] == pytest.approx(z, rel=1e-12)
    for parts in ([chunks[:4], chunks[4:]], [chunks[:1], chunks[1:5], chunks[5:]]):
        split, g_split = run(parts)
        assert split["loss/moe_load_balance"] == pytest.approx(lb, rel=1e-12), len(parts)
        assert split["loss/moe_z"] == pytest.approx(z, rel=1e-12), len(parts)
        assert split["loss/total"] == pytest.approx(whole["loss/total"], rel=1e-12)
        for a, b in zip(g_split, g_whole):
            torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-12)


@pytest.fixture
def model_dir(tmp_path):
    from asyncrl.tiny.tokenizer import save_tokenizer

    tok = save_tokenizer(tmp_path)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 tie_word_embeddings=True)).save_pretrained(tmp_path)
    return str(tmp_path), len(tok)


def run_steps(learner, vocab, steps, requests=()):
    sender = FrameSender(learner.batch_endpoint())
    rows = []
    try:
        for step in range(1, steps + 1):
            chunks = make_chunks(seed=step, vocab=vocab)
            n = sum(c.num_loss_tokens for c in chunks)
            sender.send(encode_batch(Batch(step, 0, chunks, n, len(chunks), token_budget=64)))
            result = learner.train_step(step, reset_reference=step in requests)
            assert result.version == step
            resets = [e.reason for e in result.events if isinstance(e, ReferenceReset)]
            rows.append({**result.metrics, "reset": resets[0] if resets else None})
    finally:
        sender.close()
    return rows


def test_adaptive_entropy_alpha_follows_the_equation_on_measured_entropy(model_dir):
    path, vocab = model_dir
    # target above the policy's entropy: c climbs by delta each step, alpha_k = c_k
    algo = AlgoConfig(entropy_control={"enabled": True, "target": 10.0, "delta": 0.05, "coef_max": 0.12})
    learner = LearnerRank(path, LearnerConfig(lr=1e-3), algo)
    try:
        rows = run_steps(learner, vocab, 5)
    finally:
        learner.shutdown()
    c = 0.0
    for r in rows:
        e = r["entropy_control/measured"]
        # exact mode: the measured e_k is the same policy's entropy the loss used
        assert e == pytest.approx(r["entropy/learner"], rel=1e-9, abs=1e-9)
        want_alpha = c if e <= 10.0 else 0.0
        assert r["entropy/coef"] == pytest.approx(want_alpha, abs=1e-12)
        c = min(c + 0.05, 0.12) if e < 10.0 else max(c - 0.05, 0.0) if e > 10.0 else c
        assert r["entropy_control/c"] == pytest.approx(c, abs=1e-12)
    assert [r["entropy/coef"] for r in rows] == pytest.approx([0.0, 0.05, 0.1, 0.12, 0.12])
    state = learner.step.state_dict()["entropy_control"]
    assert state["coef"] == pytest.approx(0.12) and state["num_updates"] == 5


def test_lagged_entropy_control_uses_the_previous_step(model_dir):
    path, vocab = model_dir
    algo = AlgoConfig(entropy_control={"enabled": True, "target": 10.0, "delta": 0.05, "measure": "lagged",
                                       "coef_max": None})
    learner = LearnerRank(path, LearnerConfig(lr=1e-3), algo)
    try:
        rows = run_steps(learner, vocab, 3)
    finally:
        learner.shutdown()
    assert "entropy_control/measured" not in rows[0]
    assert rows[1]["entropy_control/measured"] == rows[0]["entropy/learner"]
    assert [r["entropy/coef"] for r in rows] == pytest.approx([0.0, 0.0, 0.05])


def test_reference_reset_zeroes_kl_and_restarts_the_optimizer(model_dir):
    path, vocab = model_dir
    algo = AlgoConfig(kl={"coef": 1e-3, "reset_every": 3})
    learner = LearnerRank(path, LearnerConfig(lr=1e-2), algo)
    try:
        rows = run_steps(learner, vocab, 6, requests={5})
    finally:
        learner.shutdown()
    assert rows[0]["kl/mean"] == 0.0  # reference == policy at the start
    assert rows[1]["kl/mean"] > 1e-6 and rows[2]["kl/mean"] > rows[1]["kl/mean"] * 0.5
    assert rows[2]["reset"] == "every_k"
    assert rows[3]["kl/mean"] == 0.0 and rows[3]["learner/optimizer_steps"] == 1
    assert [r["learner/optimizer_steps"] for r in rows[:3]] == [1, 2, 3]
    assert rows[4]["reset"] == "requested" and rows[5]["kl/mean"] == 0.0
    assert rows[5]["learner/optimizer_steps"] == 1
    assert rows[5]["reset"] == "every_k" and rows[5]["kl/resets_total"] == 3
    assert all(rows[i]["reset"] is None for i in (0, 1, 3))
    assert math.isfinite(rows[5]["loss/total"])


def test_algo_state_is_saved_with_the_policy_and_restored(model_dir, tmp_path):
    import json

    path, vocab = model_dir
    algo = AlgoConfig(entropy_control={"enabled": True, "target": 10.0, "delta": 0.05, "coef_max": None},
                      kl={"track": True})
    learner = LearnerRank(path, LearnerConfig(lr=1e-3), algo)
    try:
        run_steps(learner, vocab, 3, requests={2})
        saved = learner.save(str(tmp_path / "ckpt"))
    finally:
        learner.shutdown()
    state = json.loads((tmp_path / "ckpt" / "algo_state.json").read_text())
    assert state["entropy_control"]["coef"] == pytest.approx(0.15) and state["num_reference_resets"] == 1
    fresh = LearnerRank(saved, LearnerConfig(lr=1e-3), algo)
    try:
        fresh.step.load_state_dict(state)
        assert fresh.step.entropy_ctl.coef == pytest.approx(0.15) and fresh.step.entropy_ctl.num_updates == 3
        assert fresh.step.state_dict() == state
    finally:
        fresh.shutdown()


# one rollout batch trained for 3 steps (N_SGD = 3): all of it, then two reuse passes in halves
def batch_plan(vocab):
    batch = make_chunks(seed=11, n=8, vocab=vocab)
    return batch, [("open", batch), ("continue", batch[:4]), ("continue", batch[4:])]


def train_plan(learner, batch, plan, first_step=1):
    sender = FrameSender(learner.batch_endpoint())
    rows = []
    try:
        for step, (role, chunks) in enumerate(plan, start=first_step):
            sender.send(encode_batch(rank_batches(step, chunks, 1, 64, role, batch)[0]))
            rows.append(learner.train_step(step).metrics)
    finally:
        sender.close()
    return rows


@torch.no_grad()
def batch_logprobs(learner, chunks):
    return policy_forward(learner.model, collate(chunks), 1024, torch.device("cpu")).logprobs.double()


DECOUPLED = AlgoConfig(decoupled=True, is_weight_cap=3.0, aggregation="token_mean", eps_low=0.2, eps_high=0.28)


def test_decoupled_steps_of_a_rollout_batch_take_the_ratio_against_its_start_policy(model_dir):
    """pi_prox is the policy the batch opened with, fixed over its 3 steps: the first step's
    ratio is 1, the later steps' is pi_theta / pi_start (checked against logprobs recomputed
    independently before step 1 and before step 2) and the clip engages.

    In float64: the learner's logprobs (its micro-batches) and the ones recomputed here (one batch
    of other rows and padding) sum in different orders. What is left is the learner keeping
    pi_prox in float32 (one rounding of each logprob, |error| <= u |log pi| with u = 2^-24): that
    moves each token's log ratio, so each ratio relatively, and so their mean, by at most
    u max |log pi|, whatever the processor. Measured: 6e-9 off 1 on the first step, 4.5e-9
    relative on the second, against that bound's 3e-7 (in float32: 7e-9 against rel=1e-5)."""
    path, vocab = model_dir
    learner = LearnerRank(path, LearnerConfig(lr=3e-2, grad_clip=100.0), DECOUPLED, dtype="float64")
    batch, plan = batch_plan(vocab)
    try:
        start = batch_logprobs(learner, plan[1][1])
        bound = 2.0**-24 * float(batch_logprobs(learner, batch).abs().max()) + 1e-12  # + float64's own error
        rows = train_plan(learner, batch, plan[:1])
        after_one = batch_logprobs(learner, plan[1][1])
        rows += train_plan(learner, batch, plan[1:], first_step=2)
    finally:
        learner.shutdown()
    assert rows[0]["ratio/mean"] == pytest.approx(1.0, rel=0, abs=bound) and rows[0]["clip/high_frac"] == 0
    ratio = torch.exp(after_one - start)
    adv = collate(plan[1][1]).advantages.double()
    assert rows[1]["ratio/mean"] == pytest.approx(float(ratio.mean()), rel=bound)
    assert abs(rows[1]["ratio/mean"] - 1.0) > 0.05
    # the clip fractions below are counted exactly: no ratio is within the bound of a clip edge
    assert float(torch.minimum((ratio - 1.28).abs(), (ratio - 0.8).abs()).min()) > 100 * bound
    assert rows[1]["clip/high_frac"] == pytest.approx(float(((ratio > 1.28) & (adv > 0)).double().mean()), abs=1e-9)
    assert rows[1]["clip/low_frac"] == pytest.approx(float(((ratio < 0.8) & (adv < 0)).double().mean()), abs=1e-9)
    assert rows[1]["clip/high_frac"] + rows[1]["clip/low_frac"] > 0 and rows[2]["ratio/mean"] != 1.0


@pytest.mark.parametrize("layout", ["sharded", "whole"])
def test_a_checkpoint_inside_a_rollout_batch_keeps_its_proximal_policy(model_dir, tmp_path, layout):
    """Saved after the step that opened the batch and resumed by a fresh learner, the batch's later
    steps are the uninterrupted run's: pi_prox travels in learner.pt. `whole`: a checkpoint as
    asyncrl wrote them before the sharded state (the full moments inside learner.pt) resumes too."""
    path, vocab = model_dir
    batch, plan = batch_plan(vocab)
    whole = LearnerRank(path, LearnerConfig(lr=3e-2, grad_clip=100.0), DECOUPLED)
    try:
        want = train_plan(whole, batch, plan)
    finally:
        whole.shutdown()
    first = LearnerRank(path, LearnerConfig(lr=3e-2, grad_clip=100.0), DECOUPLED)
    try:
        train_plan(first, batch, plan[:1])
        first.save_checkpoint(str(tmp_path / "ckpt"))
        if layout == "whole":
            meta = torch.load(tmp_path / "ckpt" / "learner.pt", weights_only=False)
            optimizer = first.backend.optimizer_state()
            optimizer = {**optimizer, **{k: {n: t.clone() for n, t in optimizer[k].items()} for k in MOMENTS}}
            for key in ("optimizer_steps", "moments"):
                del meta[key]
            torch.save({**meta, "optimizer": optimizer, "reference": None}, tmp_path / "ckpt" / "learner.pt")
            shutil.rmtree(tmp_path / "ckpt" / "state")
    finally:
        first.shutdown()
    resumed = LearnerRank(str(tmp_path / "ckpt" / "policy"), LearnerConfig(lr=3e-2, grad_clip=100.0), DECOUPLED)
    try:
        assert resumed.load_checkpoint(str(tmp_path / "ckpt")) == 1
        got = train_plan(resumed, batch, plan[1:], first_step=2)
    finally:
        resumed.shutdown()
    for g, w in zip(got, want[1:], strict=True):
        for key in ("ratio/mean", "ratio/max", "clip/high_frac", "clip/low_frac", "is_weight/mean", "loss/total"):
            assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-9), key


def test_adaptive_entropy_coefficient_moves_once_per_rollout_batch(model_dir):
    """Skywork-OR1 section 3.2.5: c moves once per training step, i.e. per rollout batch, with e_k
    estimated from that batch. Two rollout batches of 3 optimizer steps each (exact e_k, target
    above the policy's entropy): alpha is c_0 = 0 for the whole first batch and Delta for the
    second, and e_k is the first batch's mean entropy at its start, every token once."""
    path, vocab = model_dir
    algo = AlgoConfig(entropy_control={"enabled": True, "target": 10.0, "delta": 0.05, "coef_max": None})
    learner = LearnerRank(path, LearnerConfig(lr=1e-3), algo)
    batch, plan = batch_plan(vocab)
    try:
        with torch.no_grad():
            e_start = float(policy_forward(learner.model, collate(batch), 1024, torch.device("cpu")).entropy.double().mean())
        rows = train_plan(learner, batch, plan) + train_plan(learner, batch, plan, first_step=4)
    finally:
        learner.shutdown()
    assert [r["entropy/coef"] for r in rows] == pytest.approx([0.0] * 3 + [0.05] * 3, abs=1e-12)
    assert [r["entropy_control/c"] for r in rows] == pytest.approx([0.05] * 3 + [0.1] * 3, abs=1e-12)
    assert all(r["entropy_control/measured"] == pytest.approx(e_start, rel=1e-6) for r in rows[:3])
    assert rows[3]["entropy_control/measured"] != rows[0]["entropy_control/measured"]  # the second batch's
    assert learner.step.entropy_ctl.num_updates == 2
