"""docs/reference/config.md is generated from the schema's field docstrings
(tools/gen_config_reference.py): it must be the generator's output for the schema as it is now,
and every field must have a docstring to put there."""

import importlib.util
from pathlib import Path

from asyncrl.config import Config

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "tools/gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_config_reference_is_the_generated_one():
    gen = load_generator()
    committed = (ROOT / "docs/reference/config.md").read_text()
    assert committed == gen.render(), (
        "docs/reference/config.md is stale: run `python tools/gen_config_reference.py` and commit it")


def test_every_field_has_a_docstring_and_a_row():
    text = (ROOT / "docs/reference/config.md").read_text()
    assert "*(no docstring)*" not in text
    for section in ("model", "rollout", "reward", "algo", "buffer", "learner", "sync", "observe", "eval"):
        for name in type(getattr(Config(), section)).model_fields:
            assert f"| `{section}.{name}` |" in text, f"{section}.{name} has no row"


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    gen = load_generator()
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert gen.main(["--out", str(stale)]) == 0 and gen.main(["--check", "--out", str(stale)]) == 0
