"""Gemma 4 beyond the shared family cases (tests/models/test_families.py): the published files' spelling of the
global layers' shape, the multimodal checkpoint's text tower, the bidirectional-attention refusal, shared KV under
activation checkpointing, and the preset's parameter count against transformers' own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from fastlm.config.errors import ConfigError
from fastlm.models.build import num_parameters
from fastlm.models.hf import config_from_hf, import_hf
from tests.models.model_helpers import PRESET_DIR, load_preset, randomize_weights
from tests.models.test_families import CASES, FULL, SLIDING, VOCAB


def test_published_global_shape_keys_read_as_per_layer_config() -> None:
    """Google's config.json spells the global layers' shape `global_head_dim` / `num_global_key_value_heads`
    (transformers 5.25 saves `per_layer_config`): both read to the same model."""
    _, fields = CASES["gemma4"]
    saved = transformers.Gemma4TextConfig(**fields).to_dict()
    published = {key: value for key, value in saved.items() if key != "per_layer_config"}
    published |= {"global_head_dim": fields["global_head_dim"],
                  "num_global_key_value_heads": fields["num_global_key_value_heads"]}
    assert config_from_hf(published).architecture() == config_from_hf(saved).architecture()
    assert config_from_hf(saved).layer_kv_shape(1) == (1, 32)
    # without attention_k_eq_v transformers ignores num_global_key_value_heads: the global layers keep num_kv_heads
    plain = config_from_hf(published | {"attention_k_eq_v": False})
    assert plain.layer_kv_shape(1) == (fields["num_key_value_heads"], 32)


def test_bidirectional_attention_is_refused_naming_the_feature() -> None:
    """`use_bidirectional_attention: all` (every token sees every other) is not a decoder's attention: one line
    names the key and the fix."""
    _, fields = CASES["gemma4"]
    with pytest.raises(ConfigError) as caught:
        config_from_hf(transformers.Gemma4TextConfig(**{**fields, "use_bidirectional_attention": "all"}).to_dict())
    message = caught.value.render()
    print(message)
    assert "use_bidirectional_attention" in message and "causal attention over text" in message


@pytest.mark.parametrize("offload", [False, True])
def test_shared_kv_and_per_layer_inputs_under_activation_checkpointing(offload: bool) -> None:
    """KV-sharing layers take their source layer's keys and values as block inputs: with every block recomputed
    in backward (and its input offloaded), even after another forward in between, loss and gradients equal the
    plain step's, in float64."""
    from fastlm.losses.spec import LossNormalizers, LossTargets
    from fastlm.models.decoder import build_model

    _, fields = CASES["gemma4-per-layer-inputs-shared-kv"]
    config = config_from_hf(transformers.Gemma4TextConfig(**fields).to_dict())
    torch.manual_seed(0)
    model = build_model(config).double()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1).reshape(-1)
    normalizers = LossNormalizers(tokens=float((labels != -100).sum()))

    def step() -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss = model(ids, LossTargets(labels=labels), normalizers).loss
        with torch.no_grad():  # another forward before the backward recomputes the blocks
            model.logits(ids.flip(1))
        loss.backward()
        return float(loss), [p.grad.clone() for p in model.parameters()]

    plain_loss, plain = step()
    model.set_memory_savers(checkpointing=True, offload=offload)
    loss, grads = step()
    worst = max(float((g - p).abs().max()) for g, p in zip(grads, plain))
    print(f"shared KV + PLE, checkpointing (offload {offload}): loss diff {abs(loss - plain_loss):.2e}, grad {worst:.2e}")
    assert abs(loss - plain_loss) < 1e-12 and worst < 1e-12
    assert all(p.grad is not None for p in model.layer_inputs.parameters())


def test_multimodal_gemma4_imports_its_text_tower(tmp_path: Path) -> None:
    """A Gemma4ForConditionalGeneration folder with vision and audio towers: the text tower comes in (the other
    towers' tensors left out) and its logits equal the multimodal model's on text."""
    _, fields = CASES["gemma4"]
    vision = transformers.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                             position_embedding_size=64)
    audio = transformers.Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           subsampling_conv_channels=[8, 4], output_proj_dims=16)
    config = transformers.Gemma4Config(text_config=transformers.Gemma4TextConfig(**fields).to_dict(),
                                       vision_config=vision.to_dict(), audio_config=audio.to_dict())
    config.text_config._attn_implementation = "eager"
    reference = transformers.Gemma4ForConditionalGeneration(config).eval()
    randomize_weights(reference, seed=13)
    reference.save_pretrained(tmp_path)
    model = import_hf(tmp_path).eval()
    assert model.config.type == "gemma4"
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = torch.tanh(model.logits(ids) / 3.0) * 3.0  # the final softcap of the case
        error = float((ours - reference(input_ids=ids).logits).abs().max())
    print(f"multimodal gemma4 text tower: fp32 logits max abs err {error:.2e}")
    assert error <= 1e-5


@pytest.mark.parametrize("name", ["gemma4-e2b", "gemma4-31b"])
def test_preset_count_equals_transformers_count(name: str) -> None:
    """The presets' analytic counts equal transformers' parameter count of the same text config (meta device);
    E2B without its per-layer embedding table is Google's "2.3B effective"."""
    config = load_preset(name)
    hf = transformers.Gemma4TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim, global_head_dim=config.global_head_dim, attention_k_eq_v=config.values_from_keys,
        num_global_key_value_heads=config.num_global_kv_heads, sliding_window=config.sliding_window,
        hidden_size_per_layer_input=config.per_layer_input_width, vocab_size_per_layer_input=config.vocab_size,
        num_kv_shared_layers=config.kv_shared_layers, use_double_wide_mlp=config.double_wide_mlp,
        final_logit_softcapping=30.0,
        layer_types=[SLIDING if config.is_sliding(i) else FULL for i in range(config.num_layers)])
    with torch.device("meta"):
        model = transformers.Gemma4ForCausalLM(hf)
    assert (PRESET_DIR / f"{name}.yaml").exists()
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    if name == "gemma4-e2b":
        table = config.vocab_size * config.num_layers * config.per_layer_input_width
        assert round((num_parameters(config) - table) / 1e9, 1) == 2.3


def test_kv_sharing_layers_unused_tensors_are_ignored(tmp_path: Path) -> None:
    """Published E2B / E4B files keep k/v projections and k_norm for the KV-sharing layers, which transformers
    ignores: the import leaves them out too, and the logits stay transformers'."""
    from safetensors.torch import load_file, save_file

    from tests.models.test_families import hf_model

    reference = hf_model("gemma4-per-layer-inputs-shared-kv")
    reference.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    for layer in (3, 4):  # the two KV-sharing layers of the case
        prefix = f"model.layers.{layer}.self_attn"
        tensors |= {f"{prefix}.k_proj.weight": torch.randn(16, 32), f"{prefix}.v_proj.weight": torch.randn(16, 32),
                    f"{prefix}.k_norm.weight": torch.randn(8)}
    save_file(tensors, weights, metadata={"format": "pt"})
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    model = import_hf(tmp_path).eval()
    with torch.no_grad():
        error = float((torch.tanh(model.logits(ids) / 3.0) * 3.0 - reference(ids).logits).abs().max())
    assert error <= 1e-5


def test_lora_on_keys_as_values_and_shared_kv_layers() -> None:
    """All-linear LoRA: a global layer's fused projection holds q and k rows only (keys are the values), a
    KV-sharing layer's q rows only; with perturbed adapters the logits equal the merged model's (float64), whose
    layer scalars (buffers, not parameters) came along."""
    from fastlm.engine.lora_convert import merged_model
    from fastlm.lora.attach import attach_lora, lora_layers
    from fastlm.models.decoder import build_model
    from fastlm.models.lora_config import LoraConfig

    _, fields = CASES["gemma4-per-layer-inputs-shared-kv"]
    hf = transformers.Gemma4TextConfig(**{**fields, "attention_k_eq_v": True, "num_global_key_value_heads": 1})
    config = config_from_hf(hf.to_dict())
    torch.manual_seed(0)
    model = build_model(config)
    attach_lora(model, LoraConfig(rank=2, targets=["all-linear"]))
    model.double()
    layers = lora_layers(model)
    assert [s.role for s in layers["blocks.2.attn.qkv_proj"].slices] == ["q", "k"]  # global, keys as values
    assert [s.role for s in layers["blocks.4.attn.qkv_proj"].slices] == ["q"]  # shares layer 2's keys and values
    with torch.no_grad():
        for layer in layers.values():
            for up in layer.lora_B.values():
                up.normal_(std=0.1)
        for block in model.blocks:
            block.layer_scalar.fill_(0.7)
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
        merged = merged_model(model).double()
        error = float((model.logits(ids) - merged.logits(ids)).abs().max())  # the merged model is stored in fp32
        base = build_model(config).double()
        base.load_state_dict({name: value for name, value in model.state_dict().items() if name in base.state_dict()})
        adapted = float((model.logits(ids) - base.logits(ids)).abs().max())
    print(f"LoRA vs merged max abs err {error:.2e} (adapters move the logits by {adapted:.2e})")
    assert error < 1e-5 < 1e-3 < adapted


def test_native_config_survives_the_export() -> None:
    """A fastlm-written Gemma 4 section (per-layer vocabulary left to default) reads back from its export as
    the same architecture, so a run may start from the exported checkpoint."""
    from fastlm.data.tokenizer import ByteTokenizer
    from fastlm.models.hf import config_to_hf

    _, fields = CASES["gemma4-per-layer-inputs-shared-kv"]
    native = config_from_hf(transformers.Gemma4TextConfig(**fields).to_dict()).model_copy(
        update={"per_layer_vocab_size": None})
    again = config_from_hf(config_to_hf(native, ByteTokenizer()))
    assert again.architecture() == native.architecture()


def test_kv_sharing_layers_hold_no_cache_of_their_own() -> None:
    """The generator's cache gives each layer its own shape (global heads wider, fewer) and no columns to the
    KV-sharing layers, which read their source layer's (greedy decoding equal to transformers:
    tests/models/test_families.py)."""
    from fastlm.layers.kv_cache import KVCache

    _, fields = CASES["gemma4-per-layer-inputs-shared-kv"]
    config = config_from_hf(transformers.Gemma4TextConfig(**fields).to_dict())
    layers = range(config.num_layers)
    cache = KVCache(config.num_layers, 2, config.num_heads, config.kv_heads, 32, config.head_dim, torch.float32, "cpu",
                    layer_shapes=[config.layer_kv_shape(i) for i in layers], kv_sources=[config.kv_source(i) for i in layers])
    assert [config.kv_source(i) for i in layers] == [0, 1, 2, 1, 2]
    assert [tuple(keys.shape[1:]) for keys in cache.keys] == [(2, 32, 8), (2, 32, 8), (2, 32, 16), (2, 0, 8), (2, 0, 16)]


def test_a_model_copies_after_a_training_forward() -> None:
    """A KV-sharing source leaves its keys and values for the decoder (graph tensors, which deepcopy refuses;
    the decoder takes them within the forward): a copy (the DPO reference, a generation replica) has none and
    decodes the same."""
    import copy

    from fastlm.models.decoder import build_model

    _, fields = CASES["gemma4-per-layer-inputs-shared-kv"]
    model = build_model(config_from_hf(transformers.Gemma4TextConfig(**fields).to_dict()))
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    model.logits(ids).sum().backward()  # a forward with grad: kept keys and values carry a graph
    twin = copy.deepcopy(model)
    assert twin.blocks[2].attn.keeps_kv and twin.blocks[2].attn.kept_kv is None
    with torch.no_grad():
        assert torch.equal(twin.logits(ids), model.logits(ids))
