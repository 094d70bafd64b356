"""Base class of every config section: strict (unknown keys are errors), typed, and finite: no float field of any
section takes inf or NaN (a coefficient of .inf would pass validation and skip every step)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """Strict pydantic model: unknown keys fail validation, assignments are re-validated, floats are finite."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True, allow_inf_nan=False)
