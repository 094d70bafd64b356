"""OLMo 3 <-> Hugging Face `olmo3`: OLMo 2's names; `sliding_window` with `layer_types` (derived as
transformers does when absent: every 4th layer global) and `rope_parameters` per layer type (older files:
`rope_scaling` and `rope_theta` apply to the global layers only: see `Olmo3Adapter.rope`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from fastlm.models.hf_adapter import FULL, SLIDING, Reader, plausible_layers, rope_fields, rope_parameters, rope_to_hf
from fastlm.models.llama.hf import layer_types_to_hf, window_fields
from fastlm.models.olmo2.hf import OLMO2_DEFAULTS, Olmo2Adapter
from fastlm.models.olmo3.config import GLOBAL_EVERY, Olmo3Config

DEFAULT_THETA = 500_000.0  # transformers' Olmo3Config.default_theta


class Olmo3Adapter(Olmo2Adapter):
    model_types: ClassVar[tuple[str, ...]] = ("olmo3",)
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"olmo3": {
        **OLMO2_DEFAULTS, "rope_theta": DEFAULT_THETA, "sliding_window": 4096, "layer_types": None}}
    architecture_name: ClassVar[str] = "Olmo3ForCausalLM"

    def fields(self, reader: Reader, model_type: str) -> dict[str, Any]:
        fields = super().fields(reader, model_type)
        num_layers, hf = fields["num_layers"], reader.hf
        derived = reader
        if hf.get("layer_types") is None and plausible_layers(reader, num_layers):  # transformers' default pattern
            kinds = [SLIDING if (i + 1) % GLOBAL_EVERY else FULL for i in range(num_layers)]
            derived = Reader({**hf, "layer_types": kinds}, reader.defaults, reader.source)
        windows = window_fields(derived, reader.get("sliding_window"), num_layers)
        if derived is not reader:
            reader.issues += derived.issues
        if windows["layer_types"] is None and windows["sliding_window"] is not None and not reader.issues:  # all local
            windows["layer_types"] = [SLIDING] * num_layers
        return {**fields, **windows}

    def rope(self, reader: Reader, max_positions: Any) -> dict[str, Any]:
        """The global layers' RoPE (maybe scaled) and the sliding layers' base (plain), as transformers 5.25
        reads them: `rope_parameters` per layer type; else an older file's `rope_scaling` and `rope_theta`
        for the global layers, while the sliding layers take OLMo 3's default base (500000)."""
        hf = reader.hf
        parameters = hf.get("rope_parameters")
        if isinstance(parameters, Mapping) and any(isinstance(parameters.get(kind), Mapping) for kind in (FULL, SLIDING)):
            full, full_key = rope_parameters(reader, FULL)
            local, local_key = rope_parameters(reader, SLIDING)
        else:
            if isinstance(parameters, Mapping) and parameters.get("rope_type", "default") != "default" \
                    and not hf.get("rope_scaling"):
                reader.fail("rope_parameters", "OLMo 3 reads RoPE per layer type; transformers ignores flat "
                            "rope_parameters", parameters, f"nest them under {FULL} / {SLIDING}")
            full, full_key = rope_parameters(reader) if hf.get("rope_scaling") else (
                {"rope_type": "default", "rope_theta": hf.get("rope_theta", DEFAULT_THETA)}, "rope_theta")
            local, local_key = {"rope_type": "default", "rope_theta": DEFAULT_THETA}, "rope_theta"
        theta, scaling = rope_fields(reader, full, full_key, max_positions)
        local_theta, local_scaling = rope_fields(reader, local, local_key, max_positions)
        if local_scaling is not None:
            reader.fail(f"{local_key}.rope_type", "the sliding layers' RoPE is unscaled here", local.get("rope_type"))
        return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}

    def to_hf(self, config: Olmo3Config) -> dict[str, Any]:  # type: ignore[override]
        hf = super().to_hf(config)
        for key in ("rope_theta", "rope_scaling"):
            hf.pop(key, None)
        return {**hf, "sliding_window": config.sliding_window or 4096, "layer_types": layer_types_to_hf(config),
                "rope_parameters": {FULL: rope_to_hf(config.rope_theta, config.rope_scaling),
                                    SLIDING: rope_to_hf(config.rope_local_theta, None)}}
