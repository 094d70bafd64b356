"""How every command ends on an error it expects: one message on stderr and an exit status (`exit_status`).

A `ConfigError` prints its issues (file, dotted path, value, the fix); any other expected error prints one line,
`<command>: <error>` (the error's own message names what to fix). The status says whose problem it is:
`BAD_INPUT` (2) for what the user gave, found before any work; `RUN_TIME` (1) for trouble once work began (a
full disk, a held run directory, a stop signal, a non-finite loss, a failing reward function). Under torchrun
every rank meets the same clean error, so only rank 0 prints it.
"""

from __future__ import annotations

import os
import sys

from fastlm.config.errors import ConfigError

BAD_INPUT = 2
RUN_TIME = 1


def exit_status(error: BaseException | str, status: int = BAD_INPUT, command: str = "fastlm") -> int:
    """Print `error` (an exception, or a message of the command's own) as the command's message; return `status`."""
    if os.environ.get("RANK", "0") == "0":
        message = error.render() if isinstance(error, ConfigError) else f"{command}: {error}"
        print(message, file=sys.stderr, flush=True)
    return status
