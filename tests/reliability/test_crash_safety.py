"""SIGKILL a real training process at seeded random times and inside checkpoint writing; after every kill
the newest checkpoint verifies and loads, and the resumed run logs exactly the losses of an
uninterrupted one (tools/bench/kill_soak.py runs many more kill points for docs/reliability.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from crash_harness import FAULT_POINTS, STEPS, kill_chain, write_config


@pytest.mark.slow
def test_killed_runs_resume_to_identical_losses(tmp_path: Path, reference: dict[int, float]) -> None:
    plan = ["random", f"{FAULT_POINTS[0]}@2", "startup", f"{FAULT_POINTS[1]}@2", "random", f"{FAULT_POINTS[2]}@2",
            "random", "random"]
    config = write_config(tmp_path, "killed", steps=STEPS)
    result = kill_chain(config, plan, seed=0)
    assert len(result.kills) == len(plan)
    for kill in result.kills:
        print(f"{kill.how}: checkpoint {kill.checkpoint_step}, {kill.logged_before_kill} steps logged, "
              f"{kill.temp_dirs_left} temp dirs left")
        assert kill.checkpoint_step is not None  # every attempt here starts from a checkpoint
    checkpoints = [kill.checkpoint_step for kill in result.kills]
    assert checkpoints == sorted(checkpoints), "a kill lost an already complete checkpoint"
    assert any(kill.temp_dirs_left for kill in result.kills), "no kill landed inside a checkpoint write"
    assert sorted(result.losses) == list(range(1, STEPS + 1))
    mismatched = {step: (loss, reference[step]) for step, loss in result.losses.items() if loss != reference[step]}
    assert not mismatched, f"resumed losses differ from the uninterrupted run: {mismatched}"
