"""What every config section shares: the agents' names, the config error, and the pydantic base that
rejects unknown fields, non-finite numbers and bools given for numbers."""

from __future__ import annotations

import types
from typing import Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

AGENTS = ("solver", "verifier", "corrector")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the value."""


def _is_number(annotation: Any) -> bool:
    """Whether a field holds a number (int or float, maybe optional) and not a bool."""
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_is_number(arg) for arg in get_args(annotation) if arg is not type(None))
    return annotation in (int, float)


class _Section(BaseModel):
    # Numbers are finite everywhere (`.inf` and `.nan` are rejected), unknown fields are errors.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # Fields that have a new name: old name -> new name. Given under the old name, a field is an error
    # naming the new one; a stored run's config is read with `migrate_renamed` instead.
    RENAMED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _no_old_names(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in cls.RENAMED.items():
                if old in data:
                    raise ValueError(f"{old} is now {new} ({cls.model_fields[new].description.split(';')[0]})")
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """A bool is not a number (pydantic would read `true` as 1)."""
        if isinstance(value, bool) and _is_number(cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number, got a bool")
        return value
