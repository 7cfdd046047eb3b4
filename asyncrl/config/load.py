"""Loading a config: YAML recipe (the tiny CPU one by default), dotted overrides, validation with
messages that name the field and what is allowed, and the resolved copy in the run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.config.schema import Config

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set `a.b.c`; a numeric part indexes a list of sections (`stages.1.max_tokens=12`)."""
    keys = dotted.split(".")
    node: Any = tree
    for depth, k in enumerate(keys):
        last = depth == len(keys) - 1
        if isinstance(node, list):
            if not k.isdigit() or int(k) >= len(node):
                raise ConfigError(f"override {dotted!r}: {k!r} is not an index of a list of {len(node)}")
            k = int(k)
        elif not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {'.'.join(keys[:depth])!r} is not a section")
        if last:
            node[k] = value
        else:
            node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]


def _parse_value(raw: str) -> Any:
    """3 -> int, 1e-3 -> float, true/false -> bool, null -> None, [..]/{..} -> YAML, else str.

    Unlike plain YAML 1.1, `off`, `no` and `on` stay strings (they are valid choices)."""
    raw = raw.strip()
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    if raw[:1] in "[{":
        return yaml.safe_load(raw)
    return raw


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", typed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not (part.isidentifier() or part.isdigit()) for part in key.split(".")):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted field name")
    return key, _parse_value(raw)


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field (allowed: {', '.join(_allowed_fields(e['loc'][:-1]))})"
        elif "input" in e and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {where}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def _allowed_fields(loc: tuple) -> list[str]:
    model: Any = Config
    for part in loc:
        if isinstance(part, int):  # an index into a list of sections
            continue
        model = model.model_fields[part].annotation
        while not (isinstance(model, type) and issubclass(model, BaseModel)):
            model = next(a for a in get_args(model) if a is not type(None))  # list[X], X | None
    return sorted(model.model_fields)


def config_from_dict(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (the tiny CPU default when path is None), apply dotted overrides, validate."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    tree = yaml.safe_load(path.read_text()) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    for text in overrides or []:
        _set_dotted(tree, *parse_override(text))
    return config_from_dict(tree)


def write_resolved(cfg: Config, run_dir: Path) -> Path:
    """Write the fully resolved config (defaults included) into the run directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    out.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    return out
