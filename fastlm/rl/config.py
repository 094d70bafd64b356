"""The `rl:` section: the verifiable task, rollout sampling, advantages, warm-up and updates per rollout."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel


class AdditionTaskConfig(ConfigModel):
    type: Literal["addition"] = "addition"
    max_operand: int = Field(9, ge=1, le=999, description="Operands are drawn from [0, max_operand].")


class ReverseTaskConfig(ConfigModel):
    type: Literal["reverse"] = "reverse"
    length: int = Field(3, ge=1, le=32)
    alphabet: str = Field("abcde", min_length=2, pattern=r"^[a-z]+$", description="Lower-case letters only.")


TaskConfig = Annotated[Union[AdditionTaskConfig, ReverseTaskConfig], Field(discriminator="type")]


class RLConfig(ConfigModel):
    """Online GRPO/GSPO: each rollout draws `prompts_per_rollout` prompts and `group_size` completions each.

    One optimizer step trains on the whole rollout, split into `trainer.grad_accumulation` micro-batches;
    `updates_per_rollout` steps reuse it (TRL's num_iterations), so the ratio moves off 1 and clipping acts.
    The first `warmup_steps` optimizer steps are supervised (cross-entropy on task demonstrations).
    Data parallel: `prompts_per_rollout` is per dp rank (like data.micro_batch_size); a global rollout
    holds prompts_per_rollout * dp prompts, each rank sampling its own (fastlm/rl/rollouts.py).
    """

    task: TaskConfig = Field(default_factory=AdditionTaskConfig)
    group_size: int = Field(8, ge=2, description="Completions per prompt (G).")
    prompts_per_rollout: int = Field(16, ge=1, description="Prompts per rollout on each dp rank.")
    updates_per_rollout: int = Field(2, ge=1, description="Optimizer steps on each rollout.")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy. old_logp is always the T=1 policy's.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(4, ge=1, description="Completion budget, the stop token included.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide centred rewards by the group's std, the batch's std, or not at all (TRL)."
    )
    advantage_eps: float = Field(1e-4, gt=0.0, description="Added to the std before dividing.")
    format_reward: float = Field(0.1, ge=0.0, le=1.0, description="Reward of a well-formed wrong answer.")
    warmup_steps: int = Field(0, ge=0, description="Supervised steps on demonstrations before RL.")
    lr_scale: float = Field(
        1.0, gt=0.0, le=10.0, description="Multiplier of the scheduled optimizer lr on RL steps (after warmup_steps)."
    )
    warmup_noise: float = Field(0.0, ge=0.0, lt=1.0, description="Share of demonstrations with a wrong answer.")
    warmup_demonstrations: int = Field(1024, ge=1)
    eval_prompts: int = Field(64, ge=0, description="Fixed prompts decoded greedily for eval/reward; 0 = off.")
    log_completions: int = Field(
        4, ge=0, description="Prompts, completions and rewards of the latest rollout logged at each log step "
        "(a wandb table and a metrics.jsonl record, as TRL's completions table); 0 = off."
    )

    @model_validator(mode="before")
    @classmethod
    def _default_task(cls, data: Any) -> Any:
        """`task: {max_operand: 5}` without `type:` means the addition task."""
        if isinstance(data, dict) and isinstance(data.get("task"), dict) and "type" not in data["task"]:
            data = {**data, "task": {"type": "addition", **data["task"]}}
        return data
