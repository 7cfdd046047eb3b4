"""The LoRA learner (learner.lora, learner/lora.py) in float64, against the loss written out with
the merged weight W + (alpha/r) B A.

The merged model's full-parameter gradient G_W of a layer (the plain learner's, whose own
gradient is checked against hand-computed float64 values elsewhere) gives the adapter's by the
chain rule: dL/dA = s B^T G_W and dL/dB = s G_W A^T, s = alpha / r. The adapter starts from random
A and B (B = 0, peft's start, would make dL/dA vanish and check nothing). The LoRA learner runs
on 1 rank (one micro-batch, and micro-batches of 24 tokens) and on 2 FSDP2 ranks; all must give
the written-out gradient to float64 rounding (the two sides sum in different orders: 1e-12).
"""

import functools

import pytest
import torch
from safetensors.torch import load_file
from test_learner_ranks import (F32, F64, MODES, build_model, feed, group_address, learner_cfg, mode_gradients,
                                run_ranks, step_chunks)

from asyncrl.config import AlgoConfig, ConfigError, LoraConfig
from asyncrl.learner import lora
from asyncrl.learner.collate import collate
from asyncrl.learner.model_forward import policy_forward
from asyncrl.learner.rank import LearnerRank
from asyncrl.tiny.tokenizer import save_tokenizer
from asyncrl.transport.zmq_stream import FrameSender

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
LORA = {"rank": RANK, "alpha": ALPHA}
# adapters on the (tied) embedding and the LM head too, which the learner applies itself (TokenHead)
HEAD_LORA = {**LORA, "target_modules": ["q_proj", "down_proj", "embed_tokens", "lm_head"]}
KL_ALGO = AlgoConfig(aggregation="token_mean", kl={"coef": 0.01})


def random_adapter(model_path, out, seed=1, lora_cfg=LORA):
    """An adapter directory for `model_path` with random A and B (float64), written as peft does."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    wrapped = lora.apply_lora(base, LoraConfig(**lora_cfg))
    g = torch.Generator().manual_seed(seed)
    tensors = {lora.wire_name(n): torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3
               for n, p in wrapped.named_parameters() if p.requires_grad}
    lora.write_adapter(out, tensors.items(), lora.adapter_config(wrapped, str(model_path)))
    return str(out)


def merged_model(model_path, adapter_dir, out):
    """The base with W + s B A written into every adapted linear layer and E + s (B A)^T into an
    adapted embedding, computed here from the files; a tied head untied first (it merges its own)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    adapter = load_file(f"{adapter_dir}/{lora.ADAPTER_WEIGHTS}")
    if model.config.tie_word_embeddings and any("embed_tokens" in k or "lm_head" in k for k in adapter):
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = "base_model.model." + name.removesuffix(".weight")
            if f"{key}.lora_A.weight" in adapter:
                p += SCALE * adapter[f"{key}.lora_B.weight"] @ adapter[f"{key}.lora_A.weight"]
            elif f"{key}.lora_embedding_A" in adapter:
                p += SCALE * (adapter[f"{key}.lora_embedding_B"] @ adapter[f"{key}.lora_embedding_A"]).T
    model.save_pretrained(out)
    save_tokenizer(out)
    return str(out)


def run_lora_rank(rank, world, port, model, micro_batch_tokens, lora_cfg=LORA):
    cfg = learner_cfg("torch", 2, world, F64, micro_batch_tokens=micro_batch_tokens, lora=lora_cfg)
    learner = LearnerRank(model, cfg, AlgoConfig(), dtype="float64", rank=rank, world_size=world,
                          group_address=group_address(port))
    sender = FrameSender(learner.batch_endpoint())
    grads = mode_gradients(learner, sender, rank, world)
    adapter = {n: t.clone() for n, t in learner.backend.named_full_params(trainable_only=True)}
    sender.close()
    learner.shutdown()
    return {"grads": grads, "adapter": adapter}


def full_gradients(model):
    cfg = learner_cfg("torch", 2, 1, F64, micro_batch_tokens=4096)
    learner = LearnerRank(model, cfg, AlgoConfig(), dtype="float64")
    sender = FrameSender(learner.batch_endpoint())
    grads = mode_gradients(learner, sender, 0, 1)
    sender.close()
    learner.shutdown()
    return grads


def build_models(root, lora_cfg):
    base = build_model(root / "base", tie=True)
    adapter = random_adapter(base, root / "adapter", lora_cfg=lora_cfg)
    return base, adapter, merged_model(base, adapter, root / "merged")


@functools.cache  # per (base, adapter, merged) paths: each set's gradients are computed once
def chain_rule(models):
    """The chain rule on the merged model's gradient: the adapter's gradient the loss gives. A
    linear layer's dL/dA = s B^T G, dL/dB = s G A^T; an embedding's (E + s (B A)^T) with G^T."""
    base, adapter_dir, merged = models
    adapter = load_file(f"{adapter_dir}/{lora.ADAPTER_WEIGHTS}")
    out = {}
    for mode, grads in full_gradients(merged).items():
        want = {}
        for name, g in grads.items():
            key = "base_model.model." + name.removesuffix(".weight")
            if f"{key}.lora_A.weight" in adapter:
                a, b = adapter[f"{key}.lora_A.weight"], adapter[f"{key}.lora_B.weight"]
                want[f"{key}.lora_A.default.weight"] = SCALE * b.T @ g
                want[f"{key}.lora_B.default.weight"] = SCALE * g @ a.T
            elif f"{key}.lora_embedding_A" in adapter:
                a, b = adapter[f"{key}.lora_embedding_A"], adapter[f"{key}.lora_embedding_B"]
                want[f"{key}.lora_embedding_A.default"] = SCALE * b.T @ g.T
                want[f"{key}.lora_embedding_B.default"] = SCALE * g.T @ a.T
        out[mode] = want
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("lora"), LORA)


@pytest.fixture(scope="module")
def head_models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("lora_head"), HEAD_LORA)


@pytest.mark.parametrize("world,micro_batch_tokens", [(1, 4096), (1, 24), (2, 24)])
def test_adapter_gradient_is_the_chain_rule_of_the_merged_weight(tmp_path, models, world, micro_batch_tokens):
    check_chain_rule(tmp_path, models, world, micro_batch_tokens, LORA)


@pytest.mark.parametrize("world,micro_batch_tokens", [(1, 24), (2, 24)])
def test_embedding_and_head_adapters_follow_the_chain_rule_too(tmp_path, head_models, world, micro_batch_tokens):
    """The tied embedding and the LM head each with an adapter of its own (the merged model's
    two weights differ), the head applied by the learner's TokenHead, not the layer's forward."""
    want = chain_rule(head_models)[MODES[0]]
    assert any(".embed_tokens.lora_embedding_A" in n for n in want) and any(".lm_head.lora_A" in n for n in want)
    check_chain_rule(tmp_path, head_models, world, micro_batch_tokens, HEAD_LORA)


def check_chain_rule(tmp_path, models, world, micro_batch_tokens, lora_cfg):
    _, adapter_dir, _ = models
    written_out = chain_rule(models)
    if world == 1:
        got = run_lora_rank(0, 1, None, adapter_dir, micro_batch_tokens, lora_cfg)
    else:
        got = run_ranks(tmp_path, world, run_lora_rank, adapter_dir, micro_batch_tokens, lora_cfg)
    for mode in MODES:
        want, grads = written_out[mode], got["grads"][mode]
        assert set(grads) == set(want), mode  # the adapter alone trains: no gradient on the base
        for name, g in want.items():
            # a vanishing gradient would check nothing: each is at least a million times the tolerance
            assert g.abs().max() > 1e-6, f"{mode} {name}: a vanishing gradient checks nothing"
            torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-12, msg=f"{mode} {name}")


TARGET_SETS = [("models", LORA), ("head_models", HEAD_LORA)]


@pytest.mark.parametrize("fixture,lora_cfg", TARGET_SETS)
def test_reference_is_the_base_then_the_adapter_it_was_reset_to(request, fixture, lora_cfg):
    """KL's reference with the adapter off equals the base model's logprobs (no second copy);
    after a reset it is the adapter of that moment, not the one training on."""
    from transformers import AutoModelForCausalLM

    base_path, adapter_dir, merged_path = request.getfixturevalue(fixture)
    cfg = learner_cfg("torch", 2, 1, F64, micro_batch_tokens=4096, lora=lora_cfg)
    learner = LearnerRank(adapter_dir, cfg, KL_ALGO, dtype="float64")
    mb = collate(step_chunks(1))

    def logprobs(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        return policy_forward(model, mb, 1024, torch.device("cpu"), head_fp32=True).logprobs

    reference, base, merged = learner.step.reference.logprobs(mb), logprobs(base_path), logprobs(merged_path)
    torch.testing.assert_close(reference, base, rtol=0, atol=1e-12)
    assert (merged - base).abs().max() > 1e-3  # the adapter matters: the check above could fail
    learner.step.reset_reference()
    with torch.no_grad():  # the adapter moves on after the reset; the reference must not
        for _, p in learner.backend.named_full_params(trainable_only=True):
            p.mul_(0.5)
    torch.testing.assert_close(learner.step.reference.logprobs(mb), merged, rtol=0, atol=1e-12)
    learner.shutdown()


def run_kl_steps_rank(rank, world, port, model):
    cfg = learner_cfg("torch", 2, world, F64, micro_batch_tokens=24, lora=HEAD_LORA)
    learner = LearnerRank(model, cfg, KL_ALGO, dtype="float64", rank=rank, world_size=world,
                          group_address=group_address(port))
    sender = FrameSender(learner.batch_endpoint())
    start = {n: t.clone() for n, t in learner.backend.named_full_params(trainable_only=True)}
    for step in (1, 2):
        feed(learner, sender, step, rank, world)
        learner.train_step(step)
    after = {n: t.clone() for n, t in learner.backend.named_full_params(trainable_only=True)}
    sender.close()
    learner.shutdown()
    return {"start": start, "after": after}


def test_the_kl_reference_leaves_every_adapter_training_on_two_ranks(tmp_path, head_models):
    """The reference switches the adapter off and on (peft's disable_adapter, requires_grad with
    it): on 2 FSDP2 ranks the embedding's and head's adapters, in the root's group, came back
    frozen and dropped out of the steps and the pushes after step 1."""
    got = run_ranks(tmp_path, 2, run_kl_steps_rank, head_models[1])
    assert set(got["after"]) == set(got["start"])
    assert any("lora_embedding_A" in n for n in got["after"]) and any("lm_head.lora_B" in n for n in got["after"])
    assert all(not torch.equal(got["start"][n], got["after"][n]) for n in got["start"])


def test_steps_move_only_the_adapter_and_resume_bit_exact(tmp_path, models):
    """Optimizer steps change A and B and nothing else; a checkpoint holds the adapter (peft's
    files, a model path) and its optimizer state, and the resumed learner's next steps are the
    uninterrupted ones bit for bit."""
    base_path, adapter_dir, _ = models
    cfg = learner_cfg("torch", 2, 1, F64, micro_batch_tokens=24, lora=LORA)

    def steps(learner, numbers):
        sender = FrameSender(learner.batch_endpoint())
        for step in numbers:
            feed(learner, sender, step, 0, 1)
            learner.train_step(step)
        sender.close()
        return {n: t.clone() for n, t in learner.backend.named_full_params()}

    learner = LearnerRank(adapter_dir, cfg, KL_ALGO, dtype="float64")
    start = {n: t.clone() for n, t in learner.backend.named_full_params()}
    after2 = steps(learner, [1, 2])
    moved = {n for n in start if not torch.equal(start[n], after2[n])}
    assert moved == {n for n, _ in learner.backend.named_full_params(trainable_only=True)}
    learner.save_checkpoint(str(tmp_path / "ckpt"))
    after4 = steps(learner, [3, 4])
    learner.shutdown()
    policy = tmp_path / "ckpt" / "policy"
    assert lora.is_adapter_dir(policy) and lora.adapter_base(policy) == base_path
    resumed = LearnerRank(str(policy), cfg, KL_ALGO, dtype="float64")
    assert resumed.load_checkpoint(str(tmp_path / "ckpt")) == 2
    again = steps(resumed, [3, 4])
    resumed.shutdown()
    assert all(torch.equal(after4[n], again[n]) for n in after4)


@pytest.mark.parametrize("fixture,lora_cfg", TARGET_SETS)
def test_merged_output_is_the_written_out_model(tmp_path, request, fixture, lora_cfg):
    """`final/merged`: the written-out merge; with adapters on the tied embedding and head, the two
    untied in its config, each its own merged weight."""
    from safetensors.torch import load_file as load
    from transformers import AutoConfig

    _, adapter_dir, merged_path = request.getfixturevalue(fixture)
    learner = LearnerRank(adapter_dir, learner_cfg("torch", 2, 1, F64, lora=lora_cfg), AlgoConfig(), dtype="float64")
    learner.save(str(tmp_path / "final"), merged=True)
    learner.shutdown()
    got, want = load(str(tmp_path / "final" / "merged" / "model.safetensors")), load(f"{merged_path}/model.safetensors")
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-14, msg=name)
    assert lora.is_adapter_dir(tmp_path / "final")
    assert AutoConfig.from_pretrained(tmp_path / "final" / "merged").tie_word_embeddings == (lora_cfg is LORA)


def test_bad_lora_settings_name_their_field(models):
    base_path, adapter_dir, _ = models
    cases = [({"rank": 4, "target_modules": ["qkv_fused"]}, "learner.lora.target_modules: 'qkv_fused'"),
             ({"rank": 64}, "learner.lora.rank=64 is larger than")]
    for settings, message in cases:
        with pytest.raises(ConfigError, match=message):
            LearnerRank(base_path, learner_cfg("torch", 2, 1, F64, lora=settings), AlgoConfig(), dtype="float64")
    with pytest.raises(ConfigError, match="does not fit this model"):
        LearnerRank(adapter_dir, learner_cfg("torch", 2, 1, F64, lora={**LORA, "rank": 2}), AlgoConfig(),
                    dtype="float64")


def run_deepspeed_lora_rank(rank, world, port, model, backend, stage, ckpt=None, resume=None, lora_cfg=LORA):
    """float32 (DeepSpeed has no float64 path): step 1's gradients per mode, then 3 optimizer steps
    with a KL term (the reference: the base, the adapter switched off). `ckpt`: a checkpoint after
    step 2; `resume`: load that checkpoint (`model` its policy) and run step 3 alone."""
    cfg = learner_cfg(backend, stage, world, F32, micro_batch_tokens=24, lora=lora_cfg)
    learner = LearnerRank(model, cfg, KL_ALGO, dtype="float32", rank=rank, world_size=world,
                          group_address=group_address(port))
    sender = FrameSender(learner.batch_endpoint())
    grads = mode_gradients(learner, sender, rank, world)
    learner.step.algo = KL_ALGO
    if resume:
        learner.load_checkpoint(resume)
    for step in (3,) if resume else (1, 2, 3):
        feed(learner, sender, step, rank, world)
        learner.train_step(step)
        if step == 2 and ckpt:
            learner.save_checkpoint(ckpt)
    adapter = {n: t.clone() for n, t in learner.backend.named_full_params(trainable_only=True)}
    sender.close()
    learner.shutdown()
    return {"grads": grads, "adapter": adapter}


def float32_adapter(adapter_dir, out):
    """The random adapter in float32, as a float32 learner saves one."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(adapter_dir, out, dirs_exist_ok=True)
    tensors = load_file(f"{adapter_dir}/{lora.ADAPTER_WEIGHTS}")
    save_file({k: v.float() for k, v in tensors.items()}, f"{out}/{lora.ADAPTER_WEIGHTS}")
    return str(out)


# ZeRO-3 also with the head's and embedding's adapters: TokenHead's forward uses the head's
# adapter outside the head's own, so they are registered as its external parameters too
@pytest.mark.parametrize("stage,fixture,lora_cfg", [(2, "models", LORA), (3, "models", LORA),
                                                    (3, "head_models", HEAD_LORA)])
def test_deepspeed_lora_matches_the_single_torch_rank(tmp_path, request, stage, fixture, lora_cfg):
    """ZeRO-2 and ZeRO-3 on 2 ranks: the adapter's gradient and the adapter after 3 AdamW steps are
    the single torch rank's within what float32 summation order allows (test_learner_ranks.py)."""
    adapter = float32_adapter(request.getfixturevalue(fixture)[1], tmp_path / "adapter32")
    want = run_deepspeed_lora_rank(0, 1, None, adapter, "torch", 2, lora_cfg=lora_cfg)
    ckpt = tmp_path / "ckpt"
    got = run_ranks(tmp_path, 2, run_deepspeed_lora_rank, adapter, "deepspeed", stage, str(ckpt), None, lora_cfg)
    for mode in MODES:
        assert set(got["grads"][mode]) == set(want["grads"][mode])
        for name, g in want["grads"][mode].items():
            torch.testing.assert_close(got["grads"][mode][name], g, rtol=0, atol=F32.grad_tol, msg=f"{mode} {name}")
    for name, p in want["adapter"].items():
        torch.testing.assert_close(got["adapter"][name], p, rtol=0, atol=F32.param_tol(3, 1e-3), msg=name)
    # the checkpoint after step 2 holds the adapter and its moments (none for the frozen base):
    # 2 fresh ZeRO ranks resume it and step 3 lands where the uninterrupted ranks' did
    (tmp_path / "again").mkdir()
    again = run_ranks(tmp_path / "again", 2, run_deepspeed_lora_rank, str(ckpt / "policy"), "deepspeed", stage,
                      None, str(ckpt), lora_cfg)
    moments = torch.load(ckpt / "learner.pt", weights_only=False)["moments"]
    assert len(moments) == len(got["adapter"]) and all("lora_" in n for n in moments)
    for name, p in got["adapter"].items():
        torch.testing.assert_close(again["adapter"][name], p, rtol=0, atol=1e-7, msg=f"resumed {name}")
