"""learner/lora.py's pieces without a learner: the merged weight against peft's own merge in
float64, the names a push carries, the targets' checks, the config's refusals, and a LoRA run's
saved policies found as policies."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.compat import hide_broken_torch_extras
from asyncrl.config import ConfigError, LoraConfig, config_from_dict
from asyncrl.learner import lora

hide_broken_torch_extras()


def small_model(tie=False):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        tie_word_embeddings=tie)).to(torch.float64)


def randomized(model, cfg):
    wrapped = lora.apply_lora(model, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in wrapped.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return wrapped


@pytest.mark.parametrize("tie", [False, True])
def test_merge_stream_is_w_plus_scaled_b_a_under_the_base_names(tie):
    cfg = LoraConfig(rank=4, alpha=6.0, target_modules=["q_proj", "down_proj"])
    wrapped = randomized(small_model(tie), cfg)
    base_names = {n for n, _ in small_model(tie).named_parameters()}
    got = dict(lora.merge_stream(wrapped.named_parameters(), cfg))
    assert set(got) == base_names
    for name, module in wrapped.get_base_model().named_modules():
        if name.endswith(("q_proj", "down_proj")):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            want = module.base_layer.weight + 1.5 * b @ a  # alpha / rank = 6 / 4, written out
            torch.testing.assert_close(got[f"{name.removeprefix('base_model.model.')}.weight"], want,
                                       rtol=0, atol=1e-13)
    # peft's own merge agrees
    merged = wrapped.merge_and_unload()
    for name, p in merged.named_parameters():
        torch.testing.assert_close(got[name], p, rtol=0, atol=1e-13)


EMBEDDINGS = ["q_proj", "embed_tokens", "lm_head"]


@pytest.mark.parametrize("targets", [["q_proj", "lm_head"], ["q_proj", "embed_tokens"], EMBEDDINGS])
@pytest.mark.parametrize("tie", [False, True])
def test_merge_stream_merges_embedding_and_head_adapters_and_unties_a_tied_head(tie, targets):
    """Written out: the embedding's E + s (B A)^T, the head's W + s B A; a tied base's head keeps
    the shared base weight when only the embedding is adapted, and the merged config unties them."""
    cfg = LoraConfig(rank=4, alpha=6.0, target_modules=targets)
    wrapped = randomized(small_model(tie), cfg)
    tied = lora.untied_head(wrapped)
    assert tied == (("base_model.model.model.embed_tokens.base_layer.weight" if "embed_tokens" in targets else
                     "base_model.model.model.embed_tokens.weight"), "lm_head.weight") if tie else tied is None
    got = dict(lora.merge_stream(wrapped.named_parameters(), cfg, tied))
    assert set(got) == {n for n, _ in small_model(tie=False).named_parameters()}  # the head under its own name
    model = wrapped.get_base_model()
    emb, head = model.model.embed_tokens, model.lm_head
    e = emb.weight.detach().clone()  # the base's, shared with the head's when tied
    w = head.weight.detach().clone()
    if "embed_tokens" in targets:
        a, b = emb.lora_embedding_A["default"], emb.lora_embedding_B["default"]
        e_want = e + 1.5 * (b @ a).T  # [vocab, hidden]
    else:
        e_want = e
    w_want = w + 1.5 * head.lora_B["default"].weight @ head.lora_A["default"].weight if "lm_head" in targets else w
    torch.testing.assert_close(got["model.embed_tokens.weight"], e_want, rtol=0, atol=1e-13)
    torch.testing.assert_close(got["lm_head.weight"], w_want, rtol=0, atol=1e-13)
    assert not torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])


def test_the_lm_heads_adapter_is_in_the_weight_the_learner_applies():
    """TokenHead applies the head itself: adapted_weight must give the layer's own forward."""
    wrapped = randomized(small_model(tie=True), LoraConfig(rank=4, alpha=6.0, target_modules=EMBEDDINGS))
    head = wrapped.get_output_embeddings()
    x = torch.randn(5, 32, dtype=torch.float64)
    torch.testing.assert_close(x @ lora.adapted_weight(head).T, head(x), rtol=0, atol=1e-13)
    with lora.adapter_off(wrapped):  # the KL reference: the base's head
        assert lora.adapted_weight(head) is head.base_layer.weight
    assert not torch.allclose(x @ head.base_layer.weight.T, head(x))


def test_a_push_names_tensors_as_peft_saves_them():
    assert lora.wire_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    assert lora.wire_name("base_model.model.model.embed_tokens.lora_embedding_A.default") == \
        "base_model.model.model.embed_tokens.lora_embedding_A"
    cfg = LoraConfig(rank=2, target_modules=["q_proj", "embed_tokens", "lm_head"])
    wrapped = lora.apply_lora(small_model(), cfg)
    trainable = [lora.wire_name(n) for n, p in wrapped.named_parameters() if p.requires_grad]
    from peft import get_peft_model_state_dict

    assert sorted(trainable) == sorted(get_peft_model_state_dict(wrapped, save_embedding_layers=False))


def test_all_linear_leaves_the_head_alone_and_bad_targets_name_the_field():
    model = small_model()
    chosen = lora.check_targets(model, LoraConfig(rank=2))
    assert "lm_head" not in chosen and len(chosen) == 2 * 7
    with pytest.raises(ConfigError, match=r"learner.lora.target_modules: 'wq' names no linear or embedding layer "
                                          r".*embed_tokens.*q_proj"):
        lora.check_targets(model, LoraConfig(rank=2, target_modules=["wq"]))
    # the embedding and the head only by name, and only where the engines serve adapters there
    assert lora.check_targets(model, LoraConfig(rank=2, target_modules=EMBEDDINGS), lambda: {"embed_tokens", "lm_head"})
    assert lora.check_targets(model, LoraConfig(rank=2, target_modules=EMBEDDINGS)) == [
        *(f"model.layers.{i}.self_attn.q_proj" for i in range(2)), "model.embed_tokens", "lm_head"]
    with pytest.raises(ConfigError, match=r"learner.lora.target_modules: lm_head cannot take an adapter on "
                                          r"LlamaForCausalLM: the engines serve adapters on its decoder's linear"):
        lora.check_targets(model, LoraConfig(rank=2, target_modules=["q_proj", "lm_head"]), lambda: {"embed_tokens"})
    with pytest.raises(ConfigError, match=r"learner.lora.dropout must be 0 with an adapter on the LM head"):
        lora.check_targets(model, LoraConfig(rank=2, dropout=0.1, target_modules=["lm_head"]))
    asked = []
    lora.check_targets(model, LoraConfig(rank=2), lambda: asked.append(1) or set())
    assert not asked  # no embedding targeted: vLLM is not imported to ask
    with pytest.raises(ConfigError, match=r"learner.lora.rank=33 is larger than .*q_proj \(32x32\)"):
        lora.check_targets(model, LoraConfig(rank=33, target_modules=["q_proj"]))


def test_an_adapter_that_does_not_fit_is_refused(tmp_path):
    cfg = LoraConfig(rank=2)
    wrapped = randomized(small_model(), cfg)
    tensors = [(lora.wire_name(n), p) for n, p in wrapped.named_parameters() if p.requires_grad]
    lora.write_adapter(tmp_path, tensors, lora.adapter_config(wrapped, "/base"))
    assert lora.is_adapter_dir(tmp_path) and lora.adapter_base(tmp_path) == "/base"
    assert json.loads((tmp_path / lora.ADAPTER_CONFIG).read_text())["r"] == 2
    loaded = lora.apply_lora(small_model(), cfg, tmp_path)
    assert all(torch.equal(p, dict(wrapped.named_parameters())[n]) for n, p in loaded.named_parameters())
    with pytest.raises(ConfigError, match="does not fit this model and learner.lora"):
        lora.apply_lora(small_model(), LoraConfig(rank=3), tmp_path)


def test_the_engine_asks_vllm_for_a_rank_it_serves():
    from asyncrl.rollout.vllm_engine import vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]


@pytest.mark.parametrize("override,message", [
    ({"learner": {"backend": "deepspeed", "deepspeed": {"stage": 3}, "lora": {"rank": 8}},
      "algo": {"kl": {"coef": 0.01, "reset_every": 10}}}, "learner.lora with ZeRO-3"),
    ({"sync": {"type": "nccl"}, "learner": {"lora": {"rank": 8}}}, "learner.lora pushes its adapter over sync.type=gloo"),
    ({"learner": {"num_gpus": 1}}, "sync.type=gloo cannot push from a CUDA learner"),
    ({"learner": {"lora": {"rank": 1024}}}, "less than or equal to 512"),
    ({"learner": {"lora": {"rank": 8, "dropout": 1.0}}}, "less than 1"),
])
def test_config_refuses_what_lora_cannot_do(override, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(override)


def test_a_lora_runs_saved_policies_are_found(tmp_path):
    from asyncrl.lab.offline.policy_engine import adapter_config, architecture
    from asyncrl.lab.offline.run_policies import run_policies

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"hidden_size": 8, "_name_or_path": "x"}))
    run = tmp_path / "run"
    for policy in (run / "final", run / "checkpoints" / "step_5" / "learner" / "policy"):
        policy.mkdir(parents=True)
        (policy / "adapter_config.json").write_text(json.dumps({"r": 4, "base_model_name_or_path": str(base)}))
    (run / "checkpoints" / "step_5" / "COMPLETE").write_text("{}")
    (run / "config.yaml").write_text(f"model:\n  path: {base}\n")
    assert [p.name for p in run_policies(run)] == ["start", "checkpoints/step_5", "final"]
    assert architecture(run / "final") == architecture(base) == {"hidden_size": 8}
    assert adapter_config(run / "final")["r"] == 4 and adapter_config(base) is None


def test_a_gpu_lora_learner_pushes_its_adapter_over_gloo():
    cfg = config_from_dict({"learner": {"num_gpus": 1, "lora": {"rank": 16}}, "sync": {"type": "gloo"}})
    assert cfg.learner.lora.enabled and cfg.sync.type == "gloo"


def test_lora_is_accepted_on_deepspeed_zero2_and_zero3_without_resets():
    for stage in (2, 3):
        cfg = config_from_dict({"learner": {"backend": "deepspeed", "deepspeed": {"stage": stage}, "lora": {"rank": 8}},
                                "algo": {"kl": {"coef": 0.01}}})
        assert cfg.learner.lora.enabled


def test_preflight_names_a_target_the_model_lacks_before_anything_starts(tmp_path):
    from asyncrl.preflight import check_lora

    small_model().save_pretrained(tmp_path)
    check_lora(config_from_dict({"model": {"path": str(tmp_path)}, "learner": {"lora": {"rank": 4}}}))
    check_lora(config_from_dict({"learner": {"lora": {"rank": 4, "target_modules": ["q_proj"]}}}))  # builtin:tiny
    for model, settings in ((str(tmp_path), {"rank": 4, "target_modules": ["wq"]}), ("builtin:tiny", {"rank": 200})):
        with pytest.raises(ConfigError, match="learner.lora"):
            check_lora(config_from_dict({"model": {"path": model}, "learner": {"lora": settings}}))


def test_preflight_asks_vllm_whether_it_serves_an_adapter_on_the_head():
    """vLLM 0.32's Qwen2 class serves adapters on the decoder's linear layers only, its Llama class
    on the embedding and head too: the tiny model's Llama twin takes them, the Qwen2 model not."""
    from asyncrl.preflight import check_lora

    lora_cfg = {"rank": 4, "target_modules": ["q_proj", "embed_tokens", "lm_head"]}
    with pytest.raises(ConfigError, match="learner.lora.target_modules: embed_tokens cannot take an adapter on "
                                          "Qwen2ForCausalLM"):
        check_lora(config_from_dict({"learner": {"lora": lora_cfg}}))
    check_lora(config_from_dict({"model": {"tiny": {"architecture": "llama"}}, "learner": {"lora": lora_cfg}}))
    # fake engines serve whatever the learner trains
    check_lora(config_from_dict({"rollout": {"engine": "fake"}, "learner": {"lora": lora_cfg}}))
