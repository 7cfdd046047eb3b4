"""The tiny model build: loadable HF directory, tied embeddings, cache reuse, the early-stop rule
of the warm start, the spec a run's `model.tiny` asks for, and the optional softening."""

import dataclasses
import json
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import TinyModelConfig, load_config
from asyncrl.orchestrator.components import resolve_model_path
from asyncrl.tiny import build, task
from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model, new_model, sampled_accuracy, train_records, warm_start
from asyncrl.tiny.spec import spec_for
from asyncrl.tiny.measure import answer_probability, soften
from asyncrl.tiny.tokenizer import build_tokenizer

SMALL = TinyModelSpec(
    num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
    max_positions=32, warm_start_steps=5, batch_size=16, num_eval_prompts=8,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    logs: list[str] = []
    return ensure_tiny_model(SMALL, cache_dir=cache, log=logs.append), cache, logs


def test_directory_loads_with_transformers_and_embeddings_are_tied(built):
    path, _, logs = built
    assert any("warm start: step 5/5" in line for line in logs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert (path / "model.safetensors").exists()
    ids = torch.tensor([tokenizer.encode("3+4=")])
    assert model(input_ids=ids).logits.shape == (1, 4, len(tokenizer))


def test_warm_start_report_records_accuracies(built):
    path, _, _ = built
    report = json.loads((path / "warm_start.json").read_text())
    for key in ("eval_sampled_accuracy", "eval_greedy_accuracy", "train_seconds", "trained_answer_probability"):
        assert key in report
    assert 0.0 <= report["eval_sampled_accuracy"] <= 1.0
    assert report["spec"]["warm_start_steps"] == 5


def test_second_call_reuses_the_cache_without_training(built):
    path, cache, _ = built
    stamp = (path / "warm_start.json").stat().st_mtime_ns
    logs: list[str] = []
    assert ensure_tiny_model(SMALL, cache_dir=cache, log=logs.append) == path
    assert logs == []
    assert (path / "warm_start.json").stat().st_mtime_ns == stamp


def test_different_specs_get_different_paths_and_keys():
    other = TinyModelSpec(**{**SMALL.__dict__, "seed": 1})
    assert other.key() != SMALL.key()
    assert SMALL.key() == TinyModelSpec(**SMALL.__dict__).key()
    assert TinyModelSpec(task=task.TinyTaskSpec(max_operand=30)).key() != TinyModelSpec().key()


def test_concurrent_builders_of_one_spec_build_once(tmp_path):
    spec = TinyModelSpec(**{**SMALL.__dict__, "warm_start_steps": 2, "num_eval_prompts": 2})
    logs: list[str] = []
    paths: list = []
    workers = [
        threading.Thread(target=lambda: paths.append(ensure_tiny_model(spec, cache_dir=tmp_path, log=logs.append)))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(paths) == 2 and paths[0] == paths[1]
    assert sum("warm start: step 2/2" in line for line in logs) == 1
    assert [p.name for p in (tmp_path / "tiny_models").iterdir() if p.is_dir()] == [paths[0].name]


def test_soften_is_a_temperature_on_the_logits_and_hits_its_target():
    tokenizer = build_tokenizer()
    model = new_model(SMALL, tokenizer).eval()
    records = train_records(SMALL)[:16]
    ids = torch.tensor([tokenizer.encode("12+5=\\boxed{17}")])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    target = answer_probability(model, tokenizer, records) / 4
    tau = soften(model, tokenizer, records, target)
    assert tau > 1.0
    assert answer_probability(model, tokenizer, records) == pytest.approx(target, rel=1e-3)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, before / tau, atol=1e-5)
    assert soften(model, tokenizer, records, target=1.0) == 1.0


def scripted(accuracies):
    """A stand-in for the sampled-accuracy measurement: returns the given values in turn."""
    values = iter(accuracies)
    return lambda model: next(values)


def run_warm_start(spec, measure, on_check=None):
    logs: list[str] = []
    model = new_model(spec, build_tokenizer())
    return warm_start(model, build_tokenizer(), spec, logs.append, on_check, measure), logs


def test_warm_start_stops_at_the_first_check_that_reaches_the_target():
    spec = dataclasses.replace(SMALL, warm_start_steps=40, check_every=2, target_sampled_accuracy=0.3)
    report, logs = run_warm_start(spec, scripted([0.1, 0.29, 0.3, 0.9]))
    # checks after steps 2, 4, 6: 0.3 reaches 0.3 (>=), so training stops at step 6, not at 40
    assert report["steps"] == 6 and report["reached_target"] is True
    assert report["sampled_accuracy_curve"] == [[2, 0.1], [4, 0.29], [6, 0.3]]
    assert any("stopped at step 6" in line for line in logs)


def test_warm_start_that_never_reaches_the_target_trains_every_step_and_warns():
    spec = dataclasses.replace(SMALL, warm_start_steps=7, check_every=3, target_sampled_accuracy=0.3)
    report, logs = run_warm_start(spec, scripted([0.1, 0.2]))
    assert report["steps"] == 7 and report["reached_target"] is False
    assert report["sampled_accuracy_curve"] == [[3, 0.1], [6, 0.2]]
    assert any("never reached 0.3" in line for line in logs)


def test_without_a_target_it_trains_to_the_end_checking_only_for_on_check():
    spec = dataclasses.replace(SMALL, warm_start_steps=4, check_every=2, target_sampled_accuracy=None)
    report, _ = run_warm_start(spec, scripted([]))  # measuring at all would raise StopIteration
    assert report["steps"] == 4 and report["sampled_accuracy_curve"] == []
    seen: list = []
    report, _ = run_warm_start(spec, scripted([0.5, 0.95]), on_check=lambda step, acc: seen.append((step, acc)))
    assert report["steps"] == 4 and seen == [(2, 0.5), (4, 0.95)]


def test_the_stop_rule_measures_by_sampling_every_train_problem_seeded():
    spec = dataclasses.replace(SMALL, check_samples_per_problem=1)
    tokenizer = build_tokenizer()
    model = new_model(spec, tokenizer).eval()
    first = sampled_accuracy(model, tokenizer, spec)
    assert first == sampled_accuracy(model, tokenizer, spec)  # seeded: a spec's build repeats
    assert 0.0 <= first <= 1.0
    assert (first * len(train_records(spec))).is_integer()  # one sample of every train problem


def test_the_llama_twin_is_the_qwen2_build_relabelled(built):
    path, cache, _ = built
    logs: list[str] = []
    twin = ensure_tiny_model(dataclasses.replace(SMALL, architecture="llama"), cache_dir=cache, log=logs.append)
    assert twin != path and not any("warm start" in line for line in logs)  # no second warm start
    qwen, llama = AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(twin)
    assert llama.config.model_type == "llama" and llama.config.tie_word_embeddings
    ids = torch.tensor([AutoTokenizer.from_pretrained(twin).encode("3+4=\\boxed{7}")])
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, qwen(ids).logits, rtol=0, atol=0)
    report = json.loads((twin / "warm_start.json").read_text())
    assert (report["twin_of"], report["twin_max_logit_diff"], report["spec"]["architecture"]) == (path.name, 0.0, "llama")
    for other in ({"num_experts": 4}, {"task": "calc_tool"}):  # the twin is the dense arithmetic model's
        with pytest.raises(ValueError, match="model.tiny.architecture=llama is the dense arithmetic model's twin"):
            TinyModelConfig(architecture="llama", **other)


def test_the_default_config_asks_for_the_default_spec_and_each_setting_reaches_it():
    assert spec_for(TinyModelConfig()) == TinyModelSpec()
    assert spec_for(load_config().model.tiny) == TinyModelSpec()
    changed = TinyModelConfig(target_sampled_accuracy=None, soften_to_probability=0.3, warm_start_steps=300,
                              lr=1e-3, seed=4)
    spec = spec_for(changed)
    assert (spec.target_sampled_accuracy, spec.soften_to_probability, spec.warm_start_steps, spec.lr, spec.seed) == (
        None, 0.3, 300, 1e-3, 4)


@pytest.mark.parametrize("override", [
    {"target_sampled_accuracy": 0.5}, {"target_sampled_accuracy": None}, {"soften_to_probability": 0.3},
    {"warm_start_steps": 801}, {"lr": 1e-3}, {"seed": 1}, {"architecture": "llama"},
])
def test_every_model_tiny_setting_changes_the_cache_key(override):
    assert spec_for(TinyModelConfig(**override)).key() != TinyModelSpec().key()


def test_the_format_version_is_part_of_the_key(monkeypatch):
    before = TinyModelSpec().key()
    from asyncrl.tiny import spec

    monkeypatch.setattr(spec, "FORMAT_VERSION", spec.FORMAT_VERSION + 1)
    assert TinyModelSpec().key() != before


def test_a_run_builds_the_tiny_model_its_config_asks_for(monkeypatch):
    asked: list = []
    monkeypatch.setattr(build, "ensure_tiny_model", lambda spec, log: asked.append(spec) or "/built")
    cfg = load_config(None, ["model.tiny.target_sampled_accuracy=0.5"])
    assert resolve_model_path(cfg) == "/built"
    assert asked == [dataclasses.replace(TinyModelSpec(), target_sampled_accuracy=0.5)]
