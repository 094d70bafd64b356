"""`PromptRecord`, one rollout prompt: in a module of its own (standard library only) so that the process
that runs user environments (fastlm/rl/user_code.py) can unpickle one without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptRecord:
    text: str  # what is encoded (a conversation rendered by the chat template)
    columns: dict[str, Any] = field(default_factory=dict)
    prompt: Any = None  # what reward functions get as the prompt (the messages of a conversation); None: text

    @property
    def shown(self) -> Any:
        return self.text if self.prompt is None else self.prompt
