"""SIGTERM / SIGINT on a real `fastlm train`: finish the step, checkpoint, exit 0, and resume to the losses of an
uninterrupted run; a second signal exits at once."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from crash_harness import STEPS, finish, logged_steps, start, step_losses, verify_checkpoints, wait_for, write_config


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_checkpoints_and_exits_cleanly(tmp_path: Path, reference: dict[int, float],
                                                   stop_signal: signal.Signals) -> None:
    # checkpoint_every 0: only the signal (or the end) writes one, so a checkpoint proves the handler ran
    config = write_config(tmp_path, "signalled", steps=STEPS, checkpoint_every=0)
    process = start(config, resume=False)
    wait_for(lambda: logged_steps(config) >= 3, process, "three logged steps")
    process.send_signal(stop_signal)
    status, stderr = finish(process)
    print(stderr)
    assert status == 0, stderr
    stopped_at = verify_checkpoints(config)
    assert stopped_at is not None and 3 <= stopped_at < STEPS
    assert f"stopped by {stop_signal.name} after step {stopped_at}/{STEPS}" in stderr and "--resume" in stderr
    assert logged_steps(config) == stopped_at  # the step in flight was finished and logged, nothing after it
    status, stderr = finish(start(config, resume=True))
    assert status == 0, stderr
    assert step_losses(config) == reference


def test_second_signal_exits_at_once(tmp_path: Path) -> None:
    config = write_config(tmp_path, "twice", steps=STEPS, checkpoint_every=0)
    process = start(config, resume=False)
    wait_for(lambda: logged_steps(config) >= 1, process, "a logged step")
    process.send_signal(signal.SIGTERM)
    process.send_signal(signal.SIGINT)  # a different signal, so the two are never merged into one delivery
    status, stderr = finish(process)
    assert status in (128 + signal.SIGTERM, 128 + signal.SIGINT), stderr
    assert "second signal" in stderr and "exiting now without a checkpoint" in stderr
    assert verify_checkpoints(config) is None  # nothing half-written is visible as a checkpoint
