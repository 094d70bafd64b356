"""What the mixture-of-experts families (qwen3_moe, mixtral, olmoe) share, torch-free: the `moe:` section
of their configs, the sizing of a sparse block (total and active parameters) and the HF weight rules of
the experts (one tensor per expert and projection in a checkpoint, our row-stacked blocks here)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel
from fastlm.models.hf_adapter import Reader, WeightRule


class MoESettings(ConfigModel):
    """The sparse MLP: a softmax top-k router over `num_experts` SwiGLU experts of width `ffn_size`."""

    num_experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1, description="Experts per token (HF num_experts_per_tok).")
    ffn_size: int = Field(256, ge=1, description="Each expert's intermediate size (HF moe_intermediate_size).")
    normalize_top_k: bool = Field(True, description="Renormalise the top-k probabilities to sum to 1 (HF norm_topk_prob).")
    aux_loss_coef: float = Field(0.01, ge=0.0, description="Weight of the load-balancing loss (HF router_aux_loss_coef).")
    z_loss_coef: float = Field(0.0, ge=0.0, description="Weight of the router z-loss.")
    backend: Literal["auto", "grouped", "gather", "loop"] = Field(
        "auto", description="Experts' GEMMs: grouped (torch._grouped_mm), gather, loop (reference); auto picks.")

    @model_validator(mode="after")
    def _check_top_k(self) -> MoESettings:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is more than num_experts {self.num_experts}; pick top_k <= num_experts")
        return self

    def layer_parameters(self, hidden_size: int) -> int:
        """Router and experts of one sparse MLP."""
        return self.num_experts * hidden_size + self.num_experts * 3 * hidden_size * self.ffn_size

    def active_layer_parameters(self, hidden_size: int) -> int:
        """What one token multiplies by: the router and its top_k experts."""
        return self.num_experts * hidden_size + self.top_k * 3 * hidden_size * self.ffn_size

    def hf_fields(self) -> dict[str, Any]:
        return {"num_experts_per_tok": self.top_k, "norm_topk_prob": self.normalize_top_k,
                "router_aux_loss_coef": self.aux_loss_coef, "output_router_logits": False}


def moe_settings(reader: Reader, experts_keys: tuple[str, ...], ffn_key: str, normalize: Any) -> dict[str, Any]:
    """Our `moe:` section from a config.json; the expert count is the first of `experts_keys` present
    (transformers 5 writes Qwen3-MoE's as num_local_experts, the published configs say num_experts)."""
    experts_key = next((key for key in experts_keys if key in reader.hf), experts_keys[0])
    return {"num_experts": reader.get(experts_key), "top_k": reader.get("num_experts_per_tok"),
            "ffn_size": reader.get(ffn_key), "normalize_top_k": normalize,
            "aux_loss_coef": reader.get("router_aux_loss_coef")}


def expert_rules(settings: MoESettings, base: str, hf: str, names: tuple[str, str, str],
                 hidden_size: int) -> list[WeightRule]:
    """Router and experts of one sparse MLP: `base` ours (`blocks.i.mlp`), `hf` theirs (`model.layers.i.mlp`),
    `names` the HF (gate, up, down) projection names of an expert (Mixtral: w1, w3, w2)."""
    gate, up, down = names
    experts, ffn = range(settings.num_experts), settings.ffn_size
    gate_up = tuple(f"{hf}.experts.{e}.{name}.weight" for e in experts for name in (gate, up))
    return [WeightRule(f"{base}.router.weight", (f"{hf}.gate.weight",)),
            WeightRule(f"{base}.gate_up_proj", gate_up, (ffn,) * len(gate_up)),
            WeightRule(f"{base}.down_proj", tuple(f"{hf}.experts.{e}.{down}.weight" for e in experts),
                       (hidden_size,) * settings.num_experts)]
