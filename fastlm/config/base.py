"""Base class of every config section: strict (unknown keys are errors) and typed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """Strict pydantic model: unknown keys fail validation, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)
