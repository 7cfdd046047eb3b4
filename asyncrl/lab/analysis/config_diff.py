"""What differs between the arms' configs: the report's settings column for runs that were not
made by a study (a study names each arm's own overrides itself, asyncrl/lab/study/plan.py).

Each run directory holds its resolved config.yaml, every field with its default, so comparing the
flattened files (dotted keys; a list is one value) finds every setting that differs, whether it
was given on the command line, in a recipe or changed by a new default. Left out: `name` (the
arm's name already), `resume` (how a run was started, not what it trains), `observe.*` (where and
how it logs), and any key whose value differs between the runs of one arm (its seeds). An arm
without a config.yaml takes no part. Pure: the standard library only.
"""

from __future__ import annotations

import json
from typing import Any

IGNORED = ("name", "resume")
IGNORED_SECTIONS = ("observe.",)
UNSET = "(unset)"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": [1, 2]} -> {"a.b": 1, "c": [1, 2]}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def config_diff(configs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, str]]:
    """configs: arm -> its runs' config trees ({} for a run without config.yaml). Returns arm ->
    {key: value as text} of the keys whose value is not the same in every arm, sorted by key."""
    flat = {arm: [flatten(c) for c in cs if c] for arm, cs in configs.items()}
    flat = {arm: cs for arm, cs in flat.items() if cs}
    keys = sorted({k for cs in flat.values() for c in cs for k in c})
    out: dict[str, dict[str, str]] = {arm: {} for arm in flat}
    for key in keys:
        if key in IGNORED or key.startswith(IGNORED_SECTIONS):
            continue
        per_arm = {arm: {_text(c[key]) if key in c else UNSET for c in cs} for arm, cs in flat.items()}
        if any(len(values) > 1 for values in per_arm.values()):  # differs between seeds of one arm
            continue
        if len({v for values in per_arm.values() for v in values}) > 1:
            for arm, (value,) in per_arm.items():
                out[arm][key] = value
    return out


def settings_text(diff: dict[str, str]) -> str:
    """`algo.eps_high=0.28, buffer.max_staleness=4` ('' when nothing differs)."""
    return ", ".join(f"{k}={v}" for k, v in diff.items())
