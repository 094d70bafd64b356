"""Optimizer, learning-rate schedule, training loop and distributed settings."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel

Beta = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]


class OptimizerConfig(ConfigModel):
    """Every value finite and in the range AdamW is defined on: a NaN or infinite lr, or a beta of 1,
    turns the weights into NaN at the first step, so validation refuses it instead."""

    type: Literal["adamw"] = "adamw"
    lr: float = Field(3e-3, gt=0.0, allow_inf_nan=False)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0.0, allow_inf_nan=False)
    weight_decay: float = Field(0.1, ge=0.0, allow_inf_nan=False)
    grad_clip: float | None = Field(1.0, gt=0.0, allow_inf_nan=False,
                                    description="Max global grad norm; null disables clipping.")


class ScheduleConfig(ConfigModel):
    warmup_steps: int = Field(10, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, allow_inf_nan=False, description="Final lr as a fraction of the peak.")


class TrainerConfig(ConfigModel):
    steps: int = Field(200, ge=1, description="Optimizer steps.")
    grad_accumulation: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    eval_every: int = Field(50, ge=0, description="0 disables evaluation.")
    eval_batches: int = Field(4, ge=1)
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(100, ge=0, description="0 writes only the final checkpoint.")
    keep_checkpoints: int = Field(2, ge=1)
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 autocast on CUDA, fp32 on CPU.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nonfinite: Literal["skip_step", "stop"] = Field(
        "skip_step", description="What to do with a non-finite loss or gradient."
    )
    compile: Literal["auto"] | bool = Field(
        "auto",
        description="torch.compile each decoder block (the LM head stays opaque). auto: on for CUDA, except "
        "FSDP; true: always (CPU compiles are slow); false: eager. A failed compile falls back to eager.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each block in backward instead of keeping its activations (less memory, ~1/3 more compute)."
    )
    activation_offload: bool = Field(
        False, description="With activation_checkpointing: keep each block's input in pinned CPU memory until the "
        "backward (copied out and back on a side stream, one block ahead), freeing (tokens x hidden) per layer on the GPU.",
    )
    mlp_tile_len: int = Field(
        0, ge=0, description="Run each block's norm + MLP over sequence tiles of this many positions inside one "
        "autograd node, recomputed in backward (ALST's tiled MLP): its ffn-wide intermediates never span the whole "
        "row. 0: untiled. Dense MLPs, no dropout; a few thousand positions (e.g. 8192) keep the GEMMs efficient.",
    )

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self) -> TrainerConfig:
        if self.activation_offload and not self.activation_checkpointing:
            raise ValueError("trainer.activation_offload keeps the checkpointed block inputs in host memory: "
                             "set trainer.activation_checkpointing: true too")
        return self
    export_hf: bool = Field(
        False, description="At the end, also write the final weights as a Hugging Face folder, RUN_DIR/hf (config.json "
        "+ model.safetensors + tokenizer), as `fastlm convert --from RUN_DIR --to-hf RUN_DIR/hf` would."
    )


class DistributedConfig(ConfigModel):
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    tensor_parallel: int = Field(1, ge=1, description="Ranks sharing the vocab of the LM head.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl on CUDA, gloo on CPU.")
    timeout_minutes: float = Field(
        10.0, gt=0.0, allow_inf_nan=False,
        description="Collective timeout: a rank waiting this long for a dead peer fails instead of hanging.",
    )


class RunSection(ConfigModel):
    name: str = "fastlm"
    output_dir: str = Field("runs/{name}", description="'{name}' is replaced by run.name.")
    seed: int = Field(0, ge=0, lt=2**32, description="Seeds torch, python and the data order (32 bits, as numpy's).")
    threads: int | None = Field(
        None, ge=1, description="CPU threads of torch per process; None = the cores this process may use divided "
        "by the processes on the host (LOCAL_WORLD_SIZE), at most 4 (more oversubscribe a shared machine).",
    )
    init_path: str | None = Field(
        None,
        description="Weights to start from: a fastlm run, checkpoints/ or step-* folder (its tokenizer comes along), "
        "a local HF folder (config.json + *.safetensors), or a hub name (Qwen/Qwen3-0.6B: the local HF cache's "
        "snapshot, else downloaded). The model section must match it (`fastlm convert --from-hf DIR` prints it).",
    )

    overwrite: bool = Field(
        False,
        description="Start over in a run directory that holds an earlier run (its checkpoints and "
        "metrics.jsonl are removed first). Without it a fresh run refuses such a directory; --resume continues it.",
    )
    accept_changed_data: bool = Field(
        False,
        description="Let --resume continue although a data file changed since the checkpoint (its fingerprint "
        "differs); without it such a resume is refused naming the file.",
    )

    @model_validator(mode="after")
    def _check_name(self) -> RunSection:
        if not self.name or "/" in self.name:
            raise ValueError(f"run.name {self.name!r} must be a non-empty name without '/'")
        return self

    @property
    def directory(self) -> str:
        return self.output_dir.replace("{name}", self.name)
