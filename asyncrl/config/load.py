"""Loading a config: YAML recipe (the tiny CPU one by default), dotted overrides, validation with
messages that name the field and what is allowed, and the resolved copy in the run directory.

A recipe may start from another with `base: <path>` (relative to the recipe, the working directory
or the project, or a name in configs/ such as `grpo`): the base's sections are merged field by
field under the recipe's, lists (stages) are replaced whole, and a base may have a base of its own.
A recipe to load may be named the same way (recipe_file), so the shipped ones work in any install.
Fields no recipe sets take the schema's defaults, which are the default run's values, so a recipe
of four lines behaves like the demo except where it says otherwise. Relative file paths in a recipe
(data.path, eval.data, a stage's data, model.path) are found beside the recipe first, then in the
working directory, and kept absolute; on the command line they are the working directory's.
`reward.import_path`, when not given, is the recipe's directory and the working directory: where
user reward modules are found by the run and, from its config.yaml, by the offline tools."""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.config.schema import Config

# The recipes shipped with the package: asyncrl/recipes is a link to the checkout's configs/, whose
# files a wheel carries as package data (pyproject.toml), so names resolve in any install.
CONFIGS_DIR = (Path(__file__).resolve().parents[1] / "recipes").resolve()
DEFAULT_CONFIG = CONFIGS_DIR / "tiny_cpu.yaml"
BASE_KEY = "base"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set `a.b.c`; a numeric part indexes a list of sections (`stages.1.max_tokens=12`)."""
    keys = dotted.split(".")
    node: Any = tree
    for depth, k in enumerate(keys):
        last = depth == len(keys) - 1
        if not last and keys[depth + 1].isdigit() and isinstance(node, dict) and not isinstance(node.get(k), list):
            # `stages.1.max_tokens=12` on a recipe without stages would otherwise make `stages` a
            # mapping, which validation reports as "stages: Input should be a valid list"
            raise ConfigError(f"override {dotted!r}: {'.'.join(keys[:depth + 1])!r} has no list to index "
                              f"(the recipe gives none); set the whole list first, e.g. "
                              f"{'.'.join(keys[:depth + 1])}=[{{...}}, {{...}}]")
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


def format_override(key: str, value: Any) -> str:
    """The inverse of parse_override: `key=value` text that parses back to the same typed value."""
    if value is None or isinstance(value, (bool, list, dict)):
        text = json.dumps(value)  # null, true/false, JSON flow collections (valid YAML)
    elif isinstance(value, (int, float)):
        text = repr(value)
    else:
        text = str(value)
        if _parse_value(text) != text:  # a string that would read as a number, bool or null
            raise ConfigError(f"override {key!r}: the string {text!r} cannot be given as a dotted override")
    return f"{key}={text}"


def explain(err: ValidationError, root: type[BaseModel] = Config, title: str = "invalid config") -> str:
    """A validation error as one line per field: `a.b.c: what is wrong (got value)`."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field (allowed: {', '.join(_allowed_fields(e['loc'][:-1], root))})"
        elif "input" in e and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {where}: {msg}")
    return f"{title}:\n" + "\n".join(lines)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field can hold: X, X | None, list[X], dict[str, X], Annotated[A | B, ...]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _allowed_fields(loc: tuple, root: type[BaseModel]) -> list[str]:
    models = [root]
    for part in loc:
        if isinstance(part, int):  # an index into a list of sections
            continue
        holders = [m for m in models if part in m.model_fields]
        if holders:
            models = _models_in(holders[0].model_fields[part].annotation)
        else:  # the tag of a discriminated union names the variant
            models = [m for m in models if any(part in get_args(f.annotation) for f in m.model_fields.values())]
    return sorted(models[0].model_fields) if models else []


def config_from_dict(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(explain(e)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """A key given twice in one mapping is an error, not a silent last-one-wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"{node.start_mark.name}, line {key_node.start_mark.line + 1}: "
                                  f"field {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: sections merge field by field, anything else is replaced; an empty
    mapping replaces too, so `options: {}` clears what a base set (merged, it would change nothing)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and v and isinstance(out.get(k), dict) else v
    return out


def find_recipe(name: str, recipe: Path) -> Path:
    """A recipe named by `base:` in `recipe`: a path relative to it, to the working directory or
    to the project, or a name in configs/."""
    candidates = [recipe.parent / name, Path(name), CONFIGS_DIR.parent / name, CONFIGS_DIR / name,
                  CONFIGS_DIR / f"{name}.yaml"]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    close = difflib.get_close_matches(name.removesuffix(".yaml"), shipped_recipes(), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f" (shipped recipes: {', '.join(shipped_recipes())})"
    raise ConfigError(f"{recipe}: base {name!r} not found{hint} (looked for "
                      f"{', '.join(str(c.absolute()) for c in candidates)})")


def shipped_recipes() -> list[str]:
    """The names `base:` and --config accept for the recipes shipped in configs/ (`grpo`, `studies/...`)."""
    return sorted(str(p.relative_to(CONFIGS_DIR).with_suffix("")) for p in CONFIGS_DIR.rglob("*.yaml")
                  if p.relative_to(CONFIGS_DIR).parts[0] != "twin")  # twin scenarios are not run recipes


def recipe_file(path: str | Path) -> Path:
    """`path` when it is a file, else the shipped recipe of that name (`grpo`, `studies/staleness`,
    `configs/grpo.yaml`), else `path` unchanged (reading it then says it does not exist)."""
    path = Path(path)
    if path.is_file():
        return path
    name = Path(*path.parts[1:]) if path.parts[:1] == ("configs",) and len(path.parts) > 1 else path
    for candidate in (CONFIGS_DIR / name, CONFIGS_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    return path


def read_yaml(path: Path) -> Any:
    """A YAML file's content ({} when empty); a key given twice in a mapping is an error."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:  # a stream, so YAML's error marks name the file
            return yaml.load(f, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None


def _path_fields(tree: dict) -> list[tuple[dict, str, str]]:
    """(section, key, dotted name) of every field of a recipe tree that names a file or directory."""
    found = [(tree[sec], key, f"{sec}.{key}") for sec, key in (("data", "path"), ("eval", "data"), ("model", "path"))
             if isinstance(tree.get(sec), dict) and isinstance(tree[sec].get(key), str)]
    for i, stage in enumerate(tree.get("stages") or []):
        for j, mix in enumerate((stage.get("data") or []) if isinstance(stage, dict) else []):
            if isinstance(mix, dict) and isinstance(mix.get("path"), str):
                found.append((mix, "path", f"stages.{i}.data.{j}.path"))
    return found


def _anchor_paths(tree: dict, recipe: Path) -> None:
    """Relative paths in a recipe name files beside the recipe (as `base:` does), else in the working
    directory; either way they become absolute, so the run's config.yaml means the same from any
    directory (the offline tools read it). A data file found in neither is an error naming both."""
    for section, key, dotted in _path_fields(tree):
        value = section[key]
        if value.startswith("builtin:") or Path(value).expanduser().is_absolute():
            continue
        beside, here = (recipe.parent / value).absolute(), Path(value).absolute()
        if beside.exists():
            section[key] = str(beside.resolve())
        elif here.exists():
            section[key] = str(here.resolve())
        elif dotted != "model.path":  # a model path may be a Hugging Face hub id
            raise ConfigError(f"{recipe}: {dotted} {value!r} does not exist (looked beside the recipe, {beside}, "
                              f"and in the working directory, {here})")


def read_recipe(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """A recipe's tree with its bases merged underneath and its paths anchored (_anchor_paths)."""
    tree = read_yaml(path)
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    _anchor_paths(tree, path)
    base = tree.pop(BASE_KEY, None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be one recipe path, got {base!r}")
    base_path = find_recipe(base, path)
    if base_path in _chain or base_path == path.resolve():
        raise ConfigError(f"{path}: base {base!r} leads back to itself")
    return _merge(read_recipe(base_path, (*_chain, path.resolve())), tree)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (the tiny CPU default when path is None) with its bases, apply dotted overrides
    (each field at most once), validate."""
    recipe = recipe_file(path) if path else DEFAULT_CONFIG
    tree = read_recipe(recipe)
    given: dict[str, str] = {}
    for text in overrides or []:
        key, value = parse_override(text)
        if key in given:
            raise ConfigError(f"override {key!r} is given twice ({given[key]!r} and {text!r})")
        given[key] = text
        _set_dotted(tree, key, value)
    _add_import_path(tree, recipe)
    return config_from_dict(tree)


def _add_import_path(tree: dict, recipe: Path) -> None:
    """reward.import_path, unless the recipe (or a run's config.yaml) states it: the recipe's
    directory (not for a shipped recipe) and the working directory."""
    reward = tree.setdefault("reward", {})
    if not isinstance(reward, dict) or "import_path" in reward:
        return  # as given (validation names a mistake)
    dirs = [] if recipe.resolve().is_relative_to(CONFIGS_DIR) else [str(recipe.resolve().parent)]
    reward["import_path"] = list(dict.fromkeys([*dirs, os.getcwd()]))


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML (every field, defaults included)."""
    return yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False)


def write_resolved(cfg: Config, run_dir: Path) -> Path:
    """Write the fully resolved config (defaults included) into the run directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    out.write_text(dump_config(cfg))
    return out
