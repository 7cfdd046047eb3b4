"""The tiny model build: loadable HF directory, tied embeddings, cache reuse, softening."""

import json
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.tiny import task
from asyncrl.tiny.build import TinyModelSpec, ensure_tiny_model, new_model, train_records
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
