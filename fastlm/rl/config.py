"""The `rl:` section: the verifiable task, rollout sampling, advantages, warm-up and updates per rollout."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from fastlm.config.base import ConfigModel
from fastlm.config.user_code import UserCodeConfig
from fastlm.generation.backend_config import (
    MOVED_TO_BACKEND,
    BackendConfig,
    NativeBackendConfig,
    default_backend_type,
)
from fastlm.rl.environments.config import EnvironmentConfig


class AdditionTaskConfig(ConfigModel):
    type: Literal["addition"] = "addition"
    max_operand: int = Field(9, ge=1, le=999, description="Operands are drawn from [0, max_operand].")


class ReverseTaskConfig(ConfigModel):
    type: Literal["reverse"] = "reverse"
    length: int = Field(3, ge=1, le=32)
    alphabet: str = Field("abcde", min_length=2, pattern=r"^[a-z]+$", description="Lower-case letters only.")


class ArithmeticChainTaskConfig(ConfigModel):
    """Multi-step arithmetic word problems; the answer shows its steps (tens of tokens) and ends "Answer: N"."""

    type: Literal["arithmetic_chain"] = "arithmetic_chain"
    steps: int = Field(3, ge=1, le=8, description="Operations after the starting number.")
    max_operand: int = Field(9, ge=1, le=99)


TaskConfig = Annotated[
    AdditionTaskConfig | ReverseTaskConfig | ArithmeticChainTaskConfig, Field(discriminator="type")
]


class JsonlPromptsConfig(ConfigModel):
    """Prompts from a JSONL file: `prompt_field` is the text; every other field of the record is passed to
    the reward functions as a keyword argument (e.g. a reference answer)."""

    type: Literal["jsonl"] = "jsonl"
    path: str = Field(description="JSONL file, one object per line.")
    prompt_field: str = "prompt"


class RewardConfig(UserCodeConfig):
    """A reward function given as "package.module:name" (imported at start), weighted into the total reward."""

    function: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description='"package.module:function".')
    weight: float = 1.0
    name: str | None = Field(None, description="Metric name (train/rewards/<name>/...); defaults to the function's.")

    @property
    def metric_name(self) -> str:
        return self.name or self.function.rsplit(":", 1)[1]


class TeacherConfig(ConfigModel):
    """On-policy distillation (fastlm/rl/teacher.py): a frozen teacher scores every token the policy sampled, and
    its per-token reverse KL joins the advantages, A_t = reward_weight * A_group + coef * sum_k discount^k r_(t+k)
    with r = log p_teacher(y) - log p_student(y) over the completion's following tokens (Agarwal et al. 2024's
    on-policy setting; Thinking Machines' on-policy distillation: reward_weight 0, discount 0).

    `objective: gkd` instead hands the teacher's head input over the rollout's rows to the head's distillation
    child (GKD on student samples: its `kl`, e.g. jsd with beta, on the whole vocab) and leaves the advantages at
    reward_weight * A_group."""

    objective: Literal["reverse_kl", "gkd"] = Field(
        "reverse_kl", description="reverse_kl: the teacher's per-token reverse KL joins the advantage; gkd: the head's "
        "distillation child trains on the teacher's distributions over the student's samples.")

    path: str = Field(description="The teacher: a fastlm run (or checkpoints/, step-*), a Hugging Face folder or a "
                      "hub name from the local cache (as run.init_path); another size or family, the same tokenizer.")
    coef: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="Weight of the teacher term in the advantage.")
    reward_weight: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="Weight of the rewards' group "
                                 "advantage: 0 distills alone; > 0 mixes RL and distillation in one run.")
    discount: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False, description="gamma: a token's teacher term "
                            "also counts the following tokens' (discounted); 0: the token's own.")

    @model_validator(mode="after")
    def _check_gkd(self) -> TeacherConfig:
        if self.objective == "gkd" and (self.coef != 1.0 or self.discount != 0.0):
            raise ValueError("coef and discount shape the reverse_kl objective's advantage; with objective gkd the "
                             "distillation child's weight sets the teacher's share: leave them at 1 and 0")
        return self


TWO_SIDED_MODES = ("icepop", "sequence_geometric")  # a lower bound of 1/cap when cap_min is unset


class ImportanceSamplingConfig(ConfigModel):
    """Rollout corrections of the sampler-vs-trainer gap: every token's loss is weighted by a function of the
    ratio r = exp(train_logp - sampler_logp), per token or per completion (fastlm/rl/consistency.py has the
    formulas, docs/losses.md their sources), plus an optional log-ratio^2 KL to the sampler (prime-rl)."""

    mode: Literal["none", "token_truncate", "sequence_truncate", "token_mask", "sequence_mask", "icepop",
                  "sequence_geometric"] = "none"
    cap: float = Field(3.0, gt=0.0, allow_inf_nan=False, description="c, the upper bound: truncate at c, mask "
                       "above c (TRL's vllm_importance_sampling_clip_max; IcePop's beta)")
    cap_min: float | None = Field(None, gt=0.0, allow_inf_nan=False, description="The lower bound (TRL's "
                                  "vllm_importance_sampling_clip_min; IcePop's alpha): truncate modes clip from below "
                                  "at it, mask modes zero ratios under it; None: no lower bound, or 1/cap for icepop "
                                  "and sequence_geometric")
    mismatch_kl_coeff: float = Field(0.0, ge=0.0, description="k of k * (new_logp - sampler_logp)^2 per token; "
                                     "needs rl.updates_per_rollout: 1 and a policy child with top_entropy_quantile 1")

    @field_validator("cap_min")
    @classmethod
    def _check_cap_min(cls, value: float | None, info: ValidationInfo) -> float | None:
        cap = info.data.get("cap")
        if value is not None and cap is not None and not value < cap:
            raise ValueError(f"must be below cap {cap} (the band [cap_min, cap] would be empty); e.g. IcePop's "
                             "cap_min: 0.5, cap: 5.0")
        return value

    @model_validator(mode="after")
    def _check_band(self) -> ImportanceSamplingConfig:
        if self.mode in TWO_SIDED_MODES and self.cap_min is None and self.cap <= 1.0:
            raise ValueError(f"mode {self.mode} keeps ratios in [1/cap, cap] without cap_min; cap must be > 1, got "
                             f"{self.cap} (or set cap_min below it)")
        return self

    def bounds(self) -> tuple[float | None, float]:
        """(lower bound or None, upper bound) of the ratio the mode keeps or clips to."""
        low = self.cap_min if self.cap_min is not None or self.mode not in TWO_SIDED_MODES else 1.0 / self.cap
        return low, self.cap


class RLConfig(ConfigModel):
    """Online GRPO/GSPO: each rollout draws `prompts_per_rollout` prompts and `group_size` completions each.

    One optimizer step trains on the whole rollout, split into `trainer.grad_accumulation` micro-batches;
    `updates_per_rollout` steps reuse it (TRL's num_iterations), so the ratio moves off 1 and clipping acts.
    The first `warmup_steps` optimizer steps are supervised (cross-entropy on task demonstrations).
    Data parallel: `prompts_per_rollout` is per dp rank (like data.micro_batch_size); a global rollout
    holds prompts_per_rollout * dp prompts, each rank sampling its own (fastlm/rl/rollout.py).
    """

    task: TaskConfig = Field(default_factory=AdditionTaskConfig)
    prompts: JsonlPromptsConfig | None = Field(None, description="A prompt data set instead of the built-in task.")
    rewards: list[RewardConfig] = Field(
        default_factory=list, description="User reward functions; empty = the built-in task's reward."
    )
    reward_timeout_s: float = Field(60.0, gt=0.0, allow_inf_nan=False, description="Longest a user reward function's "
                                    "call for one rollout, or a user environment's constructor, reset or step call, may run "
                                    "(in its own process, killed then); past it the run stops with a checkpoint, as for one "
                                    "that raises.")
    environment: EnvironmentConfig | None = Field(
        None, description="Multi-turn episodes with tools (fastlm/rl/environments); the environment gives the reward."
    )
    nan_rewards: Literal["error", "skip"] = Field(
        "error", description="A NaN reward stops the run (error) or counts as no reward (skip, counted in the log)."
    )
    stop_tokens: list[str] | None = Field(
        None, description="Tokens that end a completion (special-token names like '<eos>' or single-token text); "
        "default: the tokenizer's EOS."
    )
    teacher: TeacherConfig | None = Field(None, description="A frozen teacher whose per-token reverse KL to the "
                                          "policy on its own samples joins the advantages (on-policy distillation).")
    importance_sampling: ImportanceSamplingConfig = Field(default_factory=ImportanceSamplingConfig)
    old_logprobs: Literal["trainer", "sampler"] = Field(
        "trainer", description="The old log-probs of a rollout: 'trainer' recomputes them with a forward of the "
        "packed rollout (the first update's ratio is 1; the sampler gap is measured and corrected); 'sampler' "
        "takes the generator's own and skips that forward (verl's bypass mode): the ratio then holds the "
        "sampler-vs-trainer gap and the clip bounds it.")
    max_policy_lag: int = Field(
        0, ge=0, le=64, description="0: each rollout is sampled by the current policy, then trained (synchronous). "
        "k >= 1: the next rollout is sampled one rollout ahead on a worker thread, from a copy of the weights, while "
        "the current one trains; a rollout trains at most k optimizer steps after the weights that sampled it "
        "(see rl.stale_samples). The ratio's old log-probs are the sampling weights' (rl.old_logprobs).")
    stale_samples: Literal["drop", "keep"] = Field(
        "drop", description="With rl.max_policy_lag: a rollout's updates that would come more than max_policy_lag "
        "steps after its sampling weights are dropped (the next rollout is served instead), or kept: trained "
        "anyway, re-weighted by the ratio to the sampler's log-probs and rl.importance_sampling's correction.")
    backend: BackendConfig = Field(
        default_factory=NativeBackendConfig, description="The generation backend that samples rollouts and the greedy "
        "eval: native (fastlm's sampler on the trainer's model, with its knobs) or transformers (transformers' "
        "generate on a Hugging Face-layout replica); fastlm/generation/backend_config.py.")
    routing_replay: bool = Field(
        False, description="MoE models: record each token's top-k experts at sampling time and route the training "
        "forwards (old log-probs and the policy loss) through them; the router's gate weights stay trained.")
    group_size: int = Field(8, ge=2, description="Completions per prompt (G).")
    prompts_per_rollout: int = Field(16, ge=1, description="Prompts per rollout on each dp rank.")
    updates_per_rollout: int = Field(2, ge=1, description="Optimizer steps on each rollout.")
    temperature: float = Field(
        1.0, ge=0.0, description="0 = greedy. RL steps train the tempered policy (logits / T, as TRL)."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off.")
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
    eval_prompts: Annotated[int, Field(ge=0)] | Annotated[float, Field(gt=0.0, lt=1.0)] | JsonlPromptsConfig = Field(
        64, description="Prompts decoded greedily for eval/reward, scored by the training rewards: a count (the "
        "built-in task samples them; with rl.prompts they are held out of the file, at most a tenth of it), a "
        "fraction of rl.prompts held out (e.g. 0.1), or a JSONL of eval prompts ({path, prompt_field}); 0 = off.",
    )
    log_completions: int = Field(
        4, ge=0, description="Prompts, completions and rewards of the latest rollout logged at each log step "
        "(a wandb table and a metrics.jsonl record, as TRL's completions table); 0 = off."
    )

    @field_validator("eval_prompts", mode="before")
    @classmethod
    def _eval_prompts_kind(cls, value: Any) -> Any:
        """One error for a number that is neither a count nor a fraction (instead of one per union member)."""
        if isinstance(value, float) and not value.is_integer() and not 0.0 < value < 1.0 or (
                isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0):
            raise ValueError("takes a count of prompts (e.g. 64), a fraction of rl.prompts below 1 (e.g. 0.1) or "
                             "an eval JSONL ({path: eval.jsonl})")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_task(cls, data: Any) -> Any:
        """`task: {max_operand: 5}` without `type:` means the addition task; `backend:` without it, native."""
        if isinstance(data, dict) and isinstance(data.get("task"), dict) and "type" not in data["task"]:
            data = {**data, "task": {"type": "addition", **data["task"]}}
        if isinstance(data, dict) and "backend" in data:
            data = {**data, "backend": default_backend_type(data["backend"])}
        return data

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """The native sampler's knobs live under rl.backend: an old top-level key names its new place."""
        moved = [key for key in MOVED_TO_BACKEND if isinstance(data, dict) and key in data]
        if moved:
            key = moved[0]
            raise ValueError(f"rl.{key} moved to rl.backend.{key} (the native backend's knob): write "
                             f"`backend: {{type: native, {key}: {json.dumps(data[key])}}}` under rl:")
        return data

    @model_validator(mode="after")
    def _check_backend(self) -> RLConfig:
        if self.backend.type == "transformers" and self.environment is not None:
            raise ValueError("rl.backend.type transformers samples single-turn completions only (no multi-turn "
                             "session); rl.environment needs rl.backend.type native")
        if self.routing_replay and self.backend.type != "native":
            raise ValueError(f"rl.routing_replay records routing in fastlm's own sampler; rl.backend.type "
                             f"{self.backend.type} cannot record it: use type native or drop routing_replay")
        if self.routing_replay and self.environment is not None:
            raise ValueError("rl.routing_replay records single-turn completions; it does not cover rl.environment's "
                             "multi-turn episodes (drop one of them)")
        return self

    @model_validator(mode="after")
    def _check_prompt_source(self) -> RLConfig:
        if self.prompts is not None and not self.rewards and self.environment is None:
            raise ValueError("rl.prompts (a prompt data set) needs rl.rewards (or an rl.environment, which scores its "
                             "episodes): the built-in reward scores the built-in task only; add e.g. rewards: "
                             "[{function: 'mypkg.rewards:exact', weight: 1.0}]")
        if isinstance(self.eval_prompts, float) and self.prompts is None:
            raise ValueError(f"rl.eval_prompts {self.eval_prompts} is a fraction of rl.prompts held out for eval, but "
                             "rl.prompts is not set; the built-in task takes a count (e.g. eval_prompts: 64)")
        if self.prompts is not None and self.warmup_steps:
            raise ValueError("rl.warmup_steps trains on the built-in task's demonstrations; with rl.prompts set "
                             "it to 0 (warm up with an SFT run and start from it with run.init_path)")
        return self

    @model_validator(mode="after")
    def _check_environment(self) -> RLConfig:
        if self.environment is not None and self.rewards:
            raise ValueError("rl.environment gives the episodes' rewards; remove rl.rewards (score inside the "
                             "environment's step instead)")
        return self

    @model_validator(mode="after")
    def _check_mismatch_kl(self) -> RLConfig:
        if self.importance_sampling.mismatch_kl_coeff > 0 and self.updates_per_rollout != 1:
            raise ValueError("rl.importance_sampling.mismatch_kl_coeff is folded into the advantages, which is exact on "
                             "the first update of a rollout only (fastlm/rl/consistency.py); set rl.updates_per_rollout: 1")
        return self
