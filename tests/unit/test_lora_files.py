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


def test_a_push_names_tensors_as_peft_saves_them():
    assert lora.wire_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    cfg = LoraConfig(rank=2)
    wrapped = lora.apply_lora(small_model(), cfg)
    trainable = [lora.wire_name(n) for n, p in wrapped.named_parameters() if p.requires_grad]
    from peft import get_peft_model_state_dict

    assert sorted(trainable) == sorted(get_peft_model_state_dict(wrapped))


def test_all_linear_leaves_the_head_alone_and_bad_targets_name_the_field():
    model = small_model()
    chosen = lora.check_targets(model, LoraConfig(rank=2))
    assert "lm_head" not in chosen and len(chosen) == 2 * 7
    with pytest.raises(ConfigError, match=r"learner.lora.target_modules: 'wq' names no linear layer .*q_proj"):
        lora.check_targets(model, LoraConfig(rank=2, target_modules=["wq"]))
    with pytest.raises(ConfigError, match=r"learner.lora.target_modules: the LM head cannot take an adapter"):
        lora.check_targets(model, LoraConfig(rank=2, target_modules=["q_proj", "lm_head"]))
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
