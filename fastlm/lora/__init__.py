"""LoRA: low-rank adapters on a frozen base, for every trainer and every model family (docs in README "LoRA").

`config` (the `model.lora` section) sits on the config floor; `layer` (the adapted linear) on the layers
floor; `attach` (which linears, switching adapters off, merged weights, adapter state) and `peft`
(PEFT files, merging for export) on the models floor; `checks` feeds `fastlm validate`.
"""
