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


def test_a_union_of_sections_gets_a_table_per_variant():
    """Variants chosen by a `type` field (`engine: Vllm | Fake`) are each documented, linked from the field."""
    from typing import Literal

    from asyncrl.config.section import _Section

    class Gloo(_Section):
        type: Literal["gloo"] = "gloo"
        """Which transport."""
        timeout_s: float = 1.0
        """Gloo's own timeout."""

    class Nccl(_Section):
        type: Literal["nccl"] = "nccl"
        """Which transport."""

    class Top(_Section):
        sync: Gloo | Nccl = Gloo()
        """How weights travel."""

    text = "\n".join(load_generator().section(Top, "", None))
    assert "| `sync` | section, one of [`type: gloo`](#sync-type-gloo), [`type: nccl`](#sync-type-nccl) |" in text
    assert "## `sync` (`type: gloo`)" in text and "## `sync` (`type: nccl`)" in text
    assert "| `sync.timeout_s` | float | `1.0` | Gloo's own timeout. |" in text
