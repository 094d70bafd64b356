"""Weights & Biases sink. It must never stop training: any failure warns once and disables the sink."""

from __future__ import annotations

import netrc
import os
import warnings
from pathlib import Path
from typing import Any

from fastlm.logging.config import WandbConfig

WANDB_HOST = "api.wandb.ai"


def _has_netrc_login() -> bool:
    """A `wandb login` leaves an api.wandb.ai entry in ~/.netrc (or the file $NETRC names)."""
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(WANDB_HOST) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(config: WandbConfig) -> str:
    """`mode: auto` -> $WANDB_MODE if set, else online when a key or login exists, else offline."""
    if config.mode != "auto":
        return config.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY") or _has_netrc_login():
        return "online"
    return "offline"


def _table(rows: list[dict[str, Any]]) -> Any:
    import wandb

    columns = list(rows[0]) if rows else []
    return wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])


class WandbSink:
    """Logs to a wandb run whose files live under the run directory."""

    def __init__(self, config: WandbConfig, run_dir: Path, default_name: str, run_config: dict[str, Any],
                 run_id: str | None = None):
        """`run_id` (a resumed run's, from its checkpoint) continues that wandb run instead of starting one."""
        self.mode = resolve_mode(config)
        self._run = None
        self._warned = False
        try:
            import wandb

            self._run = wandb.init(
                project=config.project,
                name=config.name or default_name,
                tags=config.tags or None,
                group=config.group,
                mode=self.mode,
                dir=str(run_dir),
                config=run_config,
                reinit="create_new",
                id=run_id,
                resume="allow" if run_id is not None else None,
            )
        except Exception as error:  # noqa: BLE001 - wandb may fail in many ways; training must go on
            self._warn("init", error)

    @property
    def active(self) -> bool:
        return self._run is not None

    @property
    def run_id(self) -> str | None:
        """The wandb run's id, which a checkpoint keeps so that a resume logs to the same run."""
        return None if self._run is None else self._run.id

    def _warn(self, stage: str, error: BaseException) -> None:
        if not self._warned:
            warnings.warn(
                f"wandb {stage} failed ({type(error).__name__}: {error}); continuing with metrics.jsonl only",
                RuntimeWarning,
                stacklevel=3,
            )
            self._warned = True
        self._run = None

    def log(self, step: int, metrics: dict[str, float | list[dict[str, Any]]]) -> None:
        """A list value (rows of dicts) becomes a `wandb.Table`, as TRL logs its completions."""
        if self._run is None:
            return
        try:
            self._run.log({key: _table(value) if isinstance(value, list) else value for key, value in metrics.items()},
                          step=step)
        except Exception as error:  # noqa: BLE001
            self._warn("log", error)

    def close(self) -> None:
        if self._run is None:
            return
        try:
            self._run.finish()
        except Exception as error:  # noqa: BLE001
            self._warn("finish", error)
