"""What `fastlm convert` does with LoRA runs: merge base + adapters into one model (`--merge-lora`, as a fastlm or
HF checkpoint), write HF PEFT's adapter folder on the base the run started from (`--to-peft`), and read a PEFT
adapter into a fastlm adapter folder that `model.lora.adapter_path` starts a run from (`--from-peft`).

The base is rebuilt as the trainer built it (`run.seed`, then `run.init_path`'s weights) and must have the
fingerprint the checkpoint recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import ValidationError
from safetensors.torch import save_file

from fastlm.config.errors import ConfigError
from fastlm.data.tokenizer import ByteTokenizer, Tokenizer
from fastlm.engine.convert import save_fastlm
from fastlm.engine.lora_training import checkpointed
from fastlm.lora.attach import (
    Target,
    adapter_mismatches,
    attach_lora,
    candidate_targets,
    merged_weights,
)
from fastlm.lora.peft import (
    FASTLM_ADAPTER_FILE,
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    PeftFormatError,
    from_peft,
    hf_layout,
    lora_config_from_peft,
    module_ranks,
    read_peft,
    to_peft,
)
from fastlm.models.decoder import DecoderLM, build_model
from fastlm.models.hf import FASTLM_CONFIG_FILE, config_from_hf, read_hf_config

LORA_YAML = "lora.yaml"


def merged_model(model: DecoderLM) -> DecoderLM:
    """A plain model (no model.lora) holding W + scale B A, and the base's stored buffers (Gemma 4's layer scalars)."""
    plain = build_model(model.config.model_copy(update={"lora": None}), "cpu")
    stored = {name: buffer for name, buffer in model.named_buffers() if name in plain.state_dict()}
    plain.load_state_dict({**stored, **dict(merged_weights(model))}, strict=True)
    return plain


def save_merged_fastlm(model: DecoderLM, tokenizer: Tokenizer, directory: str) -> Path:
    """A `convert --to` folder of the merged model, with the run's tokenizer saved in it and named in model.yaml
    (`data.tokenizer`): not `run.init_path`, whose weights are the base's, not these."""
    out = save_fastlm(model, directory)
    if not isinstance(tokenizer, ByteTokenizer):  # bytes are the default without a tokenizer
        tokenizer.save_pretrained(out)
        section = yaml.safe_dump({"data": {"tokenizer": {"type": "huggingface", "path": str(out.resolve())}}})
        with (out / FASTLM_CONFIG_FILE).open("a", encoding="utf-8") as handle:
            handle.write(section)
    return out


def write_peft(model: DecoderLM, targets: list[Target], init_path: str | None, directory: str) -> Path:
    """PEFT's adapter folder; its base_model_name_or_path is the run's `run.init_path` (a run without one has a
    seeded random base that PEFT cannot name or load: refused, with the export that holds it)."""
    if init_path is None:
        raise ConfigError("--to-peft: this run has no run.init_path (its base is a seeded random init, which a PEFT "
                          "adapter cannot name as base_model_name_or_path); export it whole with --merge-lora --to-hf DIR")
    lora = model.config.lora
    head_module, fan_in_fan_out = hf_layout(model.config, targets)
    tensors, adapter_config = to_peft(targets, checkpointed(model), lora, init_path, head_module, fan_in_fan_out)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    (out / PEFT_CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def import_peft(adapter: str, base: str | None, directory: str) -> str:
    """A PEFT adapter as `adapter.safetensors` (fastlm names) + `lora.yaml` (the run's model.lora and
    run.init_path lines); returns that YAML. Everything is checked against the base (on the meta device)
    before a file is written: the factors' shapes, the targets, the head."""
    adapter_config, tensors = read_peft(adapter)
    base = base or adapter_config.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ConfigError(f"--from-peft: the base model {base!r} is not a local HF folder; name it with --from DIR")
    model_config = config_from_hf(read_hf_config(base), str(Path(base) / "config.json"))
    model = build_model(model_config, "meta")
    head_module, _ = hf_layout(model_config, candidate_targets(model))
    try:
        lora = lora_config_from_peft(adapter_config, module_ranks(adapter_config, tensors, adapter, head_module))
        targets = attach_lora(model, lora)
    except ValueError as error:  # a pydantic ValidationError, a LoraTargetError, a tied head to train
        reason = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()) \
            if isinstance(error, ValidationError) else str(error)
        raise PeftFormatError(f"{Path(adapter) / PEFT_CONFIG_FILE}: does not fit {base}: {reason[:300]}") from None
    state = from_peft(targets, adapter_config, tensors, lora, head_module, adapter)
    wrong = adapter_mismatches(model, state)
    if wrong:
        raise PeftFormatError(f"{adapter}: adapter tensors that do not fit {base}: {', '.join(wrong[:4])}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: value.contiguous() for name, value in state.items()}, str(out / FASTLM_ADAPTER_FILE))
    section = lora.model_copy(update={"adapter_path": str(out.resolve())}).model_dump(mode="json", exclude_defaults=True)
    text = yaml.safe_dump({"run": {"init_path": str(Path(base).resolve())}, "model": {"lora": section}}, sort_keys=False)
    (out / LORA_YAML).write_text(text, encoding="utf-8")
    return text
