"""What the mixture-of-experts families (qwen3_moe, mixtral, olmoe) share, torch-free: the `moe:` section
of their configs (and the `MoEMLP` it builds), the sizing of a sparse block (total and active parameters),
the Llama-attention-plus-experts config Mixtral and OLMoE both are, and the HF weight rules of the experts
(one tensor per expert and projection in a checkpoint, our row-stacked blocks here)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel
from fastlm.models.hf_adapter import Reader, WeightRule
from fastlm.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    from torch import nn

    from fastlm.layers.moe import MoEMLP


class MoESettings(ConfigModel):
    """The sparse MLP: a softmax top-k router over `num_experts` SwiGLU experts of width `ffn_size`."""

    num_experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1, description="Experts per token (HF num_experts_per_tok).")
    ffn_size: int = Field(256, ge=1, description="Each expert's intermediate size (HF moe_intermediate_size).")
    normalize_top_k: bool = Field(True, description="Renormalise the top-k probabilities to sum to 1 (HF norm_topk_prob).")
    aux_loss_coef: float = Field(0.01, ge=0.0, description="Weight of the load-balancing loss (HF router_aux_loss_coef).")
    z_loss_coef: float = Field(0.0, ge=0.0, description="Weight of the router z-loss, a mean over the MoE layers "
                               "(Megatron's moe_z_loss_coeff sums them: its c is c x the MoE layers here).")
    backend: Literal["auto", "grouped", "triton", "gather", "loop"] = Field(
        "auto", description="Experts' GEMMs: grouped (torch._grouped_mm), triton (fastlm's Triton grouped GEMMs), "
                            "gather, loop (reference); auto picks.")

    @model_validator(mode="after")
    def _check_top_k(self) -> MoESettings:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is more than num_experts {self.num_experts}; pick top_k <= num_experts")
        return self

    def build(self, hidden_size: int) -> MoEMLP:
        """The sparse MLP of one block (imports torch lazily)."""
        from fastlm.layers.moe import MoEMLP

        return MoEMLP(hidden_size, self.ffn_size, self.num_experts, self.top_k, self.normalize_top_k,
                      backend=self.backend, aux_loss_coef=self.aux_loss_coef, z_loss_coef=self.z_loss_coef)

    def build_with_shared_expert(self, hidden_size: int, shared_size: int | None) -> nn.Module:
        """The sparse MLP plus a SwiGLU shared expert of width `shared_size` behind a sigmoid gate (Qwen2-MoE,
        Qwen3-Next, Qwen3.5-MoE: `fastlm.layers.shared_expert`); the sparse MLP alone when None."""
        if shared_size is None:
            return self.build(hidden_size)
        from torch import nn

        from fastlm.layers.mlp import GatedMLP
        from fastlm.layers.shared_expert import SharedExpertMLP

        return SharedExpertMLP(self.build(hidden_size), GatedMLP(hidden_size, shared_size, "silu"),
                               nn.Linear(hidden_size, 1, bias=False))

    def architecture(self) -> dict[str, Any]:
        """The fields that decide the weights' shapes and the forward's math (not loss weights, not the backend)."""
        return self.model_dump(include={"num_experts", "top_k", "ffn_size", "normalize_top_k"})

    def layer_parameters(self, hidden_size: int) -> int:
        """Router and experts of one sparse MLP."""
        return self.num_experts * hidden_size + self.num_experts * 3 * hidden_size * self.ffn_size

    def active_layer_parameters(self, hidden_size: int) -> int:
        """What one token multiplies by: the router and its top_k experts."""
        return self.num_experts * hidden_size + self.top_k * 3 * hidden_size * self.ffn_size

    def hf_fields(self) -> dict[str, Any]:
        return {"num_experts_per_tok": self.top_k, "norm_topk_prob": self.normalize_top_k,
                "router_aux_loss_coef": self.aux_loss_coef, "output_router_logits": False}


class SparseLlamaConfig(LlamaConfig):
    """Llama attention and a sparse MLP in every layer (Mixtral, OLMoE): no dense MLP, the experts' width is
    `moe.ffn_size`. A base for families, not one itself (its `type` is its subclass's)."""

    moe: MoESettings = Field(default_factory=MoESettings)

    @model_validator(mode="after")
    def _check_moe(self) -> SparseLlamaConfig:
        if self.intermediate_size is not None:
            raise ValueError(f"a {self.type} model has no dense MLP: set the experts' width in moe.ffn_size, "
                             "not intermediate_size")
        return self

    @property
    def ffn_size(self) -> int:
        return self.moe.ffn_size

    def build_block(self, layer: int) -> nn.Module:
        from fastlm.models.llama.blocks import llama_attention, pre_norm_block

        return pre_norm_block(self, llama_attention(self), self.moe.build(self.hidden_size))

    def block_parameters(self, layer: int) -> int:
        return 2 * self.hidden_size + self.attention_parameters() + self.moe.layer_parameters(self.hidden_size)

    def active_blocks_parameters(self) -> int:
        active = self.moe.active_layer_parameters(self.hidden_size)
        return self.num_layers * (2 * self.hidden_size + self.attention_parameters() + active)

    def architecture(self) -> dict[str, Any]:
        return {**super().architecture(), "moe": self.moe.architecture()}


def check_dense_layers(dense_layers: list[int], num_layers: int) -> None:
    """`dense_layers` must list distinct layers of the model (ValueError otherwise: a validator's message)."""
    bad = [layer for layer in dense_layers if not 0 <= layer < num_layers]
    if bad or len(set(dense_layers)) != len(dense_layers):
        raise ValueError(f"dense_layers {dense_layers} must list distinct layers in [0, {num_layers})")


MAX_LISTED_LAYERS = 100_000  # decoder_sparse_step != 1 lists the dense layers one by one


def hf_dense_layers(reader: Reader, num_layers: Any) -> list[int]:
    """Our `dense_layers` from transformers' `mlp_only_layers` and `decoder_sparse_step` (Qwen2-MoE,
    Qwen3-MoE, Qwen3-Next: layer i has experts iff it is not listed and (i + 1) % step == 0)."""
    listed, step = reader.get("mlp_only_layers") or [], reader.get("decoder_sparse_step")
    if not isinstance(listed, list) or not isinstance(step, int) or step < 1:
        reader.fail("decoder_sparse_step", "must be a positive integer, with mlp_only_layers a list", step)
        return []
    if step == 1:
        return sorted(set(listed))
    if not isinstance(num_layers, int) or num_layers > MAX_LISTED_LAYERS:
        reader.fail("num_hidden_layers", f"at most {MAX_LISTED_LAYERS} with decoder_sparse_step != 1", num_layers)
        return []
    return [layer for layer in range(num_layers) if layer in listed or (layer + 1) % step]


def moe_settings(reader: Reader, experts_keys: tuple[str, ...], ffn_key: str, normalize: Any) -> dict[str, Any]:
    """Our `moe:` section from a config.json; the expert count is the first of `experts_keys` present
    (transformers 5 writes Qwen3-MoE's as num_local_experts, the published configs say num_experts)."""
    experts_key = next((key for key in experts_keys if key in reader.hf), experts_keys[0])
    return {"num_experts": reader.get(experts_key), "top_k": reader.get("num_experts_per_tok"),
            "ffn_size": reader.get(ffn_key), "normalize_top_k": normalize,
            "aux_loss_coef": reader.get("router_aux_loss_coef")}


def shared_expert_parameters(hidden_size: int, shared_size: int | None) -> int:
    """A gated SwiGLU shared expert: gate, up and down projections, and the (H -> 1) gate."""
    return 0 if shared_size is None else 3 * hidden_size * shared_size + hidden_size


def gated_shared_expert_rules(settings: MoESettings, base: str, hf: str, hidden_size: int,
                              shared_size: int | None) -> list[WeightRule]:
    """The rules of a sparse MLP in transformers' Qwen2-MoE layout (`hf` the HF `model.layers.i.mlp`: router
    `gate`, `experts.e.{gate,up,down}_proj`, `shared_expert.*`, `shared_expert_gate`) for our block `base`'s
    MLP: the `MoEMLP` itself, or a `SharedExpertMLP` (routed, shared, gate) when `shared_size` is set."""
    names = ("gate_proj", "up_proj", "down_proj")
    if shared_size is None:
        return sparse_layer_rules([], settings, base, hf, names, hidden_size)
    routed = [replace(rule, ours=rule.ours.replace(f"{base}.mlp.", f"{base}.mlp.routed.", 1))
              for rule in sparse_layer_rules([], settings, base, hf, names, hidden_size)]
    shared = f"{hf}.shared_expert"
    return routed + [
        WeightRule(f"{base}.mlp.shared.gate_up_proj.weight", (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
                   (shared_size, shared_size)),
        WeightRule(f"{base}.mlp.shared.down_proj.weight", (f"{shared}.down_proj.weight",)),
        WeightRule(f"{base}.mlp.gate.weight", (f"{hf}.shared_expert_gate.weight",))]


def sparse_layer_rules(dense: list[WeightRule], settings: MoESettings, base: str, hf: str,
                       names: tuple[str, str, str], hidden_size: int) -> list[WeightRule]:
    """A layer's rules with its dense MLP's (`dense`, from the Llama-like adapter) replaced by the router and
    experts of a sparse MLP: `base` our block (`blocks.i`), `hf` the HF sparse MLP (`model.layers.i.mlp`),
    `names` the HF (gate, up, down) projection names of an expert (Mixtral: w1, w3, w2)."""
    gate, up, down = names
    experts, ffn, ours = range(settings.num_experts), settings.ffn_size, f"{base}.mlp"
    gate_up = tuple(f"{hf}.experts.{e}.{name}.weight" for e in experts for name in (gate, up))
    return [rule for rule in dense if not rule.ours.startswith(f"{ours}.")] + [
        WeightRule(f"{ours}.router.weight", (f"{hf}.gate.weight",)),
        WeightRule(f"{ours}.gate_up_proj", gate_up, (ffn,) * len(gate_up)),
        WeightRule(f"{ours}.down_proj", tuple(f"{hf}.experts.{e}.{down}.weight" for e in experts),
                   (hidden_size,) * settings.num_experts)]
