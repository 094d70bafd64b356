"""LoRA: low-rank adapters on a frozen base, for every trainer and every model family (docs in README "LoRA").

The package is the adapter mechanics, one floor above the models it adapts: `layer` (the adapted linear),
`attach` (which linears, switching adapters off, merged weights, adapter state), `peft` (PEFT files) and
`checks` (what `fastlm validate` says). Its config, the `model.lora` section, is a field of every model config,
so it lives with them (`fastlm/models/lora_config.py`); the trainer's side is `fastlm/engine/lora_training.py`,
`fastlm convert`'s `fastlm/engine/lora_convert.py`.
"""
