"""Config checks of an RL run that a user reads as one line with a fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastlm.config.errors import ConfigError
from fastlm.run_config.checks import cross_check
from fastlm.run_config.loader import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["grpo", "gspo", "grpo_gpu"])
def test_shipped_rl_configs_log_the_same_update_of_every_rollout(name: str) -> None:
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.trainer.log_every % config.rl.updates_per_rollout == 0
    assert not [issue for issue in cross_check(config) if issue.path == "trainer.log_every"]


@pytest.mark.parametrize(("log_every", "updates", "fix"), [(5, 2, 6), (10, 3, 12), (1, 2, None), (4, 2, None)])
def test_log_every_must_be_a_multiple_of_the_updates_per_rollout(log_every: int, updates: int, fix: int | None) -> None:
    overrides = [f"trainer.log_every={log_every}", f"rl.updates_per_rollout={updates}"]
    if fix is None:
        load_config(CONFIGS / "grpo.yaml", overrides)
        return
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "grpo.yaml", overrides)
    (line,) = [str(issue) for issue in caught.value.issues]
    print(line)
    assert line.startswith("trainer.log_every: is not a multiple of rl.updates_per_rollout")
    assert f"({updates})" in line and line.endswith(f"Fix: set trainer.log_every: {fix} (or 1)")


def test_mismatch_kl_with_a_top_entropy_quantile_is_refused_with_the_fix() -> None:
    """The mismatch KL is folded into the advantages, which the entropy selection zeroes on the tokens it
    leaves out: the combination is one line naming both fields."""
    overrides = ["rl.updates_per_rollout=1", "trainer.log_every=1", "rl.importance_sampling.mismatch_kl_coeff=0.1"]
    load_config(CONFIGS / "grpo.yaml", overrides)
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "grpo.yaml", [*overrides, "model.head.losses.grpo.top_entropy_quantile=0.5"])
    (line,) = [str(issue) for issue in caught.value.issues]
    print(line)
    assert line.startswith("rl.importance_sampling.mismatch_kl_coeff: is folded into the advantages, which "
                           "model.head.losses.grpo.top_entropy_quantile 0.5 zeroes")
    assert "Fix: set model.head.losses.grpo.top_entropy_quantile: 1.0, or mismatch_kl_coeff: 0" in line


def test_eval_prompts_fraction_needs_a_prompt_set_and_a_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a fraction of rl.prompts held out for eval, but rl.prompts is not set"):
        load_config(CONFIGS / "grpo.yaml", ["rl.eval_prompts=0.1"])
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "grpo.yaml", [f"rl.eval_prompts={{path: {tmp_path}/missing.jsonl}}"])
    assert [issue.path for issue in caught.value.issues] == ["rl.eval_prompts.path"]


@pytest.mark.parametrize("value", ["1.5", "-2"])
def test_eval_prompts_that_is_neither_a_count_nor_a_fraction_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "grpo.yaml", [f"rl.eval_prompts={value}"])
    (issue,) = caught.value.issues
    assert issue.path == "rl.eval_prompts" and "a fraction of rl.prompts below 1" in str(issue)


def test_a_rollout_with_fewer_completions_than_micro_batches_is_refused_before_any_work() -> None:
    overrides = ["rl.prompts_per_rollout=1", "rl.group_size=2", "trainer.grad_accumulation=8"]
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "grpo.yaml", overrides)
    (line,) = [str(issue) for issue in caught.value.issues]
    print(line)
    assert line.startswith("rl.prompts_per_rollout: x rl.group_size (2) = 2 completions per rollout cannot fill")
    assert "raise it to at least 4" in line
    load_config(CONFIGS / "grpo.yaml", ["rl.prompts_per_rollout=4", "rl.group_size=2", "trainer.grad_accumulation=8"])


def test_a_kv_cache_too_small_for_one_sequence_is_refused_before_any_work() -> None:
    """The engine's paged cache must hold one sequence of model.max_seq_len tokens; the static path ignores it."""
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "grpo.yaml", ["rl.backend.kv_cache_memory_gib=1e-6"])
    (line,) = [str(issue) for issue in caught.value.issues]
    print(line)
    assert line.startswith("rl.backend.kv_cache_memory_gib: cannot hold one sequence of model.max_seq_len") and "raise it" in line
    load_config(CONFIGS / "grpo.yaml", ["rl.backend.kv_cache_memory_gib=1e-6", "rl.backend.generation=static"])
    load_config(CONFIGS / "grpo.yaml", ["rl.backend.kv_cache_memory_gib=1"])
