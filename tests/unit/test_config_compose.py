"""Recipes that build on a base, overrides given once, and schema defaults that are the demo's."""

import json
import os

import pytest

from asyncrl.config import Config, ConfigError, dump_config, load_config
from asyncrl.preflight import resolve


def _write(path, text):
    path.write_text(text)
    return path


def test_schema_defaults_are_the_default_run():
    # a recipe of four lines must behave like the demo, so every default is the demo's value
    demo = json.loads(resolve(load_config()).model_dump_json())
    bare = json.loads(resolve(Config()).model_dump_json())
    assert demo["reward"].pop("import_path") == [os.getcwd()]  # filled in by loading, like max_model_len
    assert bare["reward"].pop("import_path") == []
    assert bare == demo


def test_minimal_recipe_gets_the_demo_values(tmp_path):
    recipe = _write(tmp_path / "mine.yaml", "model:\n  path: builtin:tiny\ndata:\n  type: jsonl\n  path: x.jsonl\n")
    _write(tmp_path / "x.jsonl", "")
    cfg = resolve(load_config(recipe))
    assert cfg.learner.lr == 3e-4 and cfg.total_steps == 300 and cfg.model.max_model_len == 64
    assert cfg.data.path == str(tmp_path / "x.jsonl") and cfg.rollout.max_tokens == 16


def test_paths_in_a_recipe_are_found_beside_it_then_in_the_working_directory(tmp_path, monkeypatch):
    task, here = tmp_path / "task", tmp_path / "here"
    (task / "stage2").mkdir(parents=True)
    here.mkdir()
    for f in (task / "train.jsonl", task / "stage2/b.jsonl", here / "heldout.jsonl"):
        _write(f, "")
    (task / "model").mkdir()
    base = _write(task / "base.yaml", "data:\n  type: jsonl\n  path: train.jsonl\n")
    recipe = _write(task / "sub.yaml", "base: base.yaml\nmodel:\n  path: model\neval:\n  data: heldout.jsonl\n"
                                       "stages:\n  - data: [{type: jsonl, path: stage2/b.jsonl}]\n")
    monkeypatch.chdir(here)
    cfg = load_config(recipe)
    assert cfg.data.path == str(task / "train.jsonl")  # beside the base recipe that names it
    assert cfg.model.path == str(task / "model") and cfg.stages[0].data[0].path == str(task / "stage2/b.jsonl")
    assert cfg.eval.data == str(here / "heldout.jsonl")  # not beside the recipe: the working directory's
    assert cfg.reward.import_path == [str(task), str(here)]
    assert load_config(recipe, ["data.path=elsewhere.jsonl"]).data.path == "elsewhere.jsonl"  # the command line's
    assert load_config(base, ["model.path=Qwen/Qwen2.5-0.5B"]).model.path == "Qwen/Qwen2.5-0.5B"  # a hub id
    stated = _write(task / "own.yaml", "base: base.yaml\nreward:\n  import_path: [/opt/rewards]\n")
    assert load_config(stated).reward.import_path == ["/opt/rewards"]  # stated: kept as it is
    (here / "heldout.jsonl").unlink()
    with pytest.raises(ConfigError, match=f"eval.data 'heldout.jsonl' does not exist \\(looked beside the recipe, "
                                          f"{task / 'heldout.jsonl'}, and in the working directory, {here / 'heldout.jsonl'}\\)"):
        load_config(recipe)


def test_config_mistakes_name_the_file_and_the_near_miss(tmp_path):
    dup = _write(tmp_path / "dup.yaml", "name: a\nseed: 1\nname: b\n")
    with pytest.raises(ConfigError, match=f"^{dup}, line 3: field 'name' is given twice$"):
        load_config(dup)
    typo = _write(tmp_path / "typo.yaml", "base: grpoo\n")
    with pytest.raises(ConfigError, match="base 'grpoo' not found; did you mean 'grpo'\\?"):
        load_config(typo)
    with pytest.raises(ConfigError, match="'stages' has no list to index .* stages=\\[\\{...\\}, \\{...\\}\\]"):
        load_config(None, ["stages.1.max_tokens=12"])


def test_base_is_inherited_field_by_field_and_overridable(tmp_path):
    _write(tmp_path / "base.yaml",
           "name: base\nlearner:\n  lr: 1.0e-5\n  grad_clip: 0.5\nbuffer:\n  max_staleness: 3\n")
    child = _write(tmp_path / "child.yaml", "base: base.yaml\nname: child\nlearner:\n  lr: 2.0e-5\n")
    cfg = load_config(child)
    assert cfg.name == "child"
    assert cfg.learner.lr == 2e-5 and cfg.learner.grad_clip == 0.5  # merged, not replaced
    assert cfg.buffer.max_staleness == 3
    assert load_config(child, ["learner.grad_clip=2.0"]).learner.grad_clip == 2.0


def test_base_by_name_from_configs_and_chains(tmp_path):
    mid = _write(tmp_path / "mid.yaml", "base: grpo\nseed: 7\n")
    top = _write(tmp_path / "top.yaml", "base: mid.yaml\nname: top\n")
    cfg, grpo = load_config(top), load_config("configs/grpo.yaml")
    assert cfg.seed == 7 and cfg.name == "top"
    assert cfg.algo.kl.coef == grpo.algo.kl.coef and cfg.buffer.max_staleness == grpo.buffer.max_staleness


def test_an_empty_mapping_clears_what_the_base_set(tmp_path):
    _write(tmp_path / "b.yaml", "env:\n  type: calculator\n  options:\n    digits: 3\n")
    child = _write(tmp_path / "c.yaml", "base: b.yaml\nenv:\n  options: {}\n")
    assert load_config(tmp_path / "b.yaml").env.options == {"digits": 3}
    cfg = load_config(child)
    assert cfg.env.options == {} and cfg.env.type == "calculator"  # the section still merges


def test_stages_list_of_a_base_is_replaced_whole(tmp_path):
    _write(tmp_path / "b.yaml", "stages:\n  - steps: 5\n  - max_tokens: 12\n")
    child = _write(tmp_path / "c.yaml", "base: b.yaml\nstages:\n  - max_tokens: 10\n")
    assert [s.max_tokens for s in load_config(child).stages] == [10]


def test_cyclic_and_missing_bases_fail(tmp_path):
    _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="leads back to itself"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="base 'nowhere.yaml' not found"):
        load_config(_write(tmp_path / "c.yaml", "base: nowhere.yaml\n"))


def test_duplicate_override_and_duplicate_yaml_key_fail():
    with pytest.raises(ConfigError, match="'learner.lr' is given twice"):
        load_config(None, ["learner.lr=0.1", "learner.lr=0.2"])


def test_duplicate_key_in_a_recipe_names_the_line(tmp_path):
    recipe = _write(tmp_path / "d.yaml", "learner:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"line 3: field 'lr' is given twice"):
        load_config(recipe)


def test_dump_config_loads_back_to_the_same_config(tmp_path):
    cfg = resolve(load_config(None, ["name=x", "eval.n=4"]))
    again = load_config(_write(tmp_path / "r.yaml", dump_config(cfg)))
    assert again == cfg


def test_a_shipped_recipe_loads_by_its_name_from_any_directory(tmp_path, monkeypatch):
    from asyncrl.config.load import CONFIGS_DIR, recipe_file

    monkeypatch.chdir(tmp_path)  # no configs/ here: what an installed asyncrl sees
    assert load_config("grpo") == load_config("configs/grpo.yaml") == load_config(CONFIGS_DIR / "grpo.yaml")
    assert recipe_file("studies/staleness") == CONFIGS_DIR / "studies" / "staleness.yaml"
    mine = _write(tmp_path / "grpo", "name: mine\n")  # a file of that name here comes first
    assert recipe_file("grpo").resolve() == mine.resolve()
    with pytest.raises(ConfigError, match="nowhere.yaml does not exist"):
        load_config("nowhere.yaml")
