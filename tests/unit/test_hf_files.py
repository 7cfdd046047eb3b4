"""The policy's Hugging Face files written as the tensors arrive (learner/hf_files.py), and what
sharded_load.py reads back from them: the names and shapes in the files' headers."""

import json

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from asyncrl.learner.hf_files import save_hf_model
from asyncrl.learner.sharded_load import file_shapes, weight_files

CONFIG = LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)


def tensors():
    g = torch.Generator().manual_seed(0)
    # 4 x 100 float32 = 1,600 bytes each, and one of 2,400 bytes: larger than the file limit below
    return {"a": torch.randn(4, 100, generator=g), "b": torch.randn(4, 100, generator=g),
            "big": torch.randn(6, 100, generator=g), "c": torch.randn(4, 100, generator=g)}


def test_tensors_over_the_file_limit_go_to_indexed_files_as_save_pretrained_names_them(tmp_path):
    want = tensors()
    save_hf_model(tmp_path, iter(want.items()), CONFIG, max_file_bytes=2000)
    # a and b (3,200 bytes together) do not share a file; big gets one of its own
    names = ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
             "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == names
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict(zip(want, names))
    assert index["metadata"]["total_size"] == 3 * 1600 + 2400
    assert weight_files(str(tmp_path)) == [tmp_path / n for n in names]
    for name, t in want.items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][name])[name], t)
    assert file_shapes(str(tmp_path))["big"][0] == (6, 100)
    assert (tmp_path / "config.json").is_file()


def test_tensors_within_the_limit_are_one_model_safetensors_and_a_resave_leaves_no_stale_file(tmp_path):
    save_hf_model(tmp_path, iter(tensors().items()), CONFIG, max_file_bytes=2000)
    want = tensors()
    save_hf_model(tmp_path, iter(want.items()), CONFIG)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    got = load_file(tmp_path / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert {n: s for n, (s, _) in file_shapes(str(tmp_path)).items()} == {n: tuple(t.shape) for n, t in want.items()}
