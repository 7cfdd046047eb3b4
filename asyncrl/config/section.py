"""The base of every config section: unknown keys are errors, each field's docstring is its help,
and an assignment is validated like a load."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
