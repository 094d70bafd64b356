"""What a loss child declares about the frozen model it needs beside the trained one.

The child that needs a teacher or a reference says so (Fast-LLM's shape), so preflight, the config
cross-checks and the training objectives read one declaration instead of a map of loss kind -> field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class FrozenModel:
    """A frozen model a child needs: a teacher (its distribution per token) or a reference (its log-probs of
    the labels). `key` is the child's field naming its checkpoint; `path` its value. Without a path a teacher
    must come from the data (or rl.teacher) and a reference is a copy of the policy."""

    role: Literal["teacher", "reference"]
    key: str
    path: str | None
