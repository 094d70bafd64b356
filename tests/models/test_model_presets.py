"""Preset files: parse through the root schema, build on meta with the analytic parameter count, size helpers."""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import PRESET_DIR, TINY_PRESETS, load_preset, make_model
from torch.utils.flop_counter import FlopCounterMode

from fastlm.models.build import count_parameters, model_flops_per_token, num_parameters
from fastlm.models.config import GPT2Config, LlamaConfig
from fastlm.models.decoder import build_model

PRESETS = sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def test_every_expected_preset_exists() -> None:
    expected = {"tiny-llama", "tiny-gpt2", "gpt2-125m", "llama-350m", "llama-1b", "qwen2-tiny", "mistral-tiny",
                *PUBLISHED}
    assert expected <= set(PRESETS)
    for name in PRESETS:
        first_line = (PRESET_DIR / f"{name}.yaml").read_text().splitlines()[0]
        assert first_line.startswith("# "), f"{name}.yaml should start with a comment saying what it is"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_builds_on_meta_with_analytic_count(name: str) -> None:
    config = load_preset(name)
    model = build_model(config, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert count_parameters(model) == num_parameters(config)


def test_preset_shapes_match_their_names() -> None:
    # GPT-2 small with vocab 50304: 124,475,904 parameters (the figure nanoGPT reports for this shape).
    assert num_parameters(load_preset("gpt2-125m")) == 124_475_904
    assert 0.33e9 < num_parameters(load_preset("llama-350m")) < 0.37e9
    assert 0.95e9 < num_parameters(load_preset("llama-1b")) < 1.15e9
    qwen, mistral = load_preset("qwen2-tiny"), load_preset("mistral-tiny")
    assert isinstance(qwen, LlamaConfig) and qwen.qkv_bias
    assert isinstance(mistral, LlamaConfig) and mistral.sliding_window
    assert isinstance(load_preset("tiny-gpt2"), GPT2Config)


# Parameter counts of the published checkpoints, from their config.json shapes (tied embeddings counted once):
# Qwen3-0.6B "0.6B" (0.44B non-embedding), Qwen3-1.7B "1.7B" (1.4B non-embedding), Llama-3.2-1B "1.24B",
# Gemma-3-1B "1B", Phi-3-mini "3.8B", Moonlight-16B-A3B "16B" (15.29B total, 2.24B active without the
# embedding and output matrices: test_moonlight_counts_without_embeddings); the 2026 zoo's smallest sizes in
# ZOO_PUBLISHED (sources in each preset's comment).
PUBLISHED = {"qwen3-0.6b": (596_049_920, 151936), "qwen3-1.7b": (1_720_574_976, 151936),
             "llama3.2-1b": (1_235_814_400, 128256), "gemma3-1b": (999_885_952, 262144),
             "phi3-mini": (3_821_079_552, 32064), "moonlight-16b-a3b": (15_960_110_208, 163840),
             # Qwen3.5 text towers ("0.8B" / "2B" add the vision tower; "35B-A3B": 3.45B active) and
             # Qwen1.5-MoE-A2.7B ("14.3B", 2.69B active): equal to transformers' own count of the same
             # config on the meta device (tests/models/test_qwen3_5.py)
             "qwen3.5-0.8b": (752_393_024, 248320), "qwen3.5-2b": (1_881_825_088, 248320),
             "qwen3.5-35b-a3b": (34_660_610_688, 248320), "qwen1.5-moe-a2.7b": (14_315_784_192, 151936)}
# The long-context sizes: Qwen3-4B "4.0B", Qwen3-8B "8.2B", Llama-3.1-8B "8.03B".
PUBLISHED.update({"qwen3-4b": (4_022_468_096, 151936), "qwen3-8b": (8_190_735_360, 151936),
                  "llama3.1-8b": (8_030_261_248, 128256)})
ZOO_PUBLISHED = {"gemma2-2b": (2_614_341_888, 256000), "olmo2-1b": (1_484_916_736, 100352),
                 "olmo3-7b": (7_298_011_136, 100278), "granite3-2b": (2_533_531_648, 49155),
                 "smollm3-3b": (3_075_098_624, 128256), "glm4-9b": (9_400_279_040, 151552),
                 "ministral3-3b": (3_429_006_336, 131072), "gpt-oss-20b": (20_914_757_184, 201088),
                 # Gemma 4 text towers: E2B "2.3B effective" (4.63B with the per-layer embedding table), 31B
                 # "30.7B" (equal to transformers' count of the same Gemma4TextConfig: test_gemma4.py)
                 "gemma4-e2b": (4_628_569_344, 262144), "gemma4-31b": (30_697_345_280, 262144)}
PUBLISHED.update(ZOO_PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_presets_print_the_published_parameter_count(name: str) -> None:
    """validate's report (its memory check refuses these on a machine they cannot train on: the report alone)."""
    from fastlm.commands.validate import describe_run
    from fastlm.run_config.loader import load_config

    count, vocab = PUBLISHED[name]
    assert load_preset(name).vocab_size == vocab
    report = describe_run(load_config(PRESET_DIR / f"{name}.yaml", ["data.source.num_documents=20"]))
    assert f"{count:,} parameters ({count / 1e6:.2f} M)" in report


def test_moonlight_counts_without_embeddings() -> None:
    """Moonshot publishes 15.29B total and 2.24B activated parameters, both without the two vocab matrices."""
    from fastlm.models import active_parameters

    config = load_preset("moonlight-16b-a3b")
    vocab_matrices = 2 * config.vocab_size * config.hidden_size
    assert round((num_parameters(config) - vocab_matrices) / 1e9, 2) == 15.29
    assert round((active_parameters(config) - vocab_matrices) / 1e9, 2) == 2.24


def test_meta_model_materialises_with_the_documented_init() -> None:
    config = load_preset("qwen2-tiny")
    model = build_model(config, device="meta")
    model.to_empty(device="cpu")
    model.init_weights()
    model.requires_grad_(False)
    std, residual = config.init_std, config.init_std / math.sqrt(2 * config.num_layers)
    block = model.blocks[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert abs(float(model.embeddings.tokens.weight.std()) - std) < 0.1 * std
    assert abs(float(block.attn.qkv_proj.weight.std()) - std) < 0.1 * std
    assert abs(float(block.attn.out_proj.weight.std()) - residual) < 0.1 * residual
    assert abs(float(block.mlp.down_proj.weight.std()) - residual) < 0.1 * residual
    assert torch.equal(block.attn.qkv_proj.bias, torch.zeros_like(block.attn.qkv_proj.bias))
    assert torch.equal(model.final_norm.weight, torch.ones_like(model.final_norm.weight))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_flops_formula_matches_flop_counter(name: str) -> None:
    """6*N_matmul: measured on the model's matmuls (norm weights and biases are elementwise, so
    they are subtracted); the 12*L*H*S attention term: measured on an explicit QK^T / PV."""
    config = load_preset(name)
    model = make_model(config, dtype=torch.float32)
    batch, seq_len = 2, 32
    tokens = batch * seq_len
    with FlopCounterMode(display=False) as counter:
        model.logits(torch.randint(0, config.vocab_size, (batch, seq_len))).sum().backward()
    elementwise = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    attention_term = 12.0 * config.num_layers * config.hidden_size * seq_len
    matmul_term = model_flops_per_token(config, seq_len) - attention_term
    assert counter.get_total_flops() / tokens == matmul_term - 6 * elementwise

    heads, dim = config.num_heads, config.head_dim
    q, k, v = (torch.randn(batch, heads, seq_len, dim, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        ((q @ k.transpose(-1, -2)).softmax(-1) @ v).sum().backward()
    assert counter.get_total_flops() * config.num_layers / tokens == attention_term


def test_sliding_window_caps_the_attention_flops() -> None:
    config = load_preset("mistral-tiny")
    window = config.sliding_window
    unwindowed = config.model_copy(update={"sliding_window": None})
    long = 4 * window
    difference = model_flops_per_token(unwindowed, long) - model_flops_per_token(config, long)
    assert difference == 12.0 * config.num_layers * config.hidden_size * (long - window)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_presets_are_cpu_sized(name: str) -> None:
    config = load_preset(name)
    assert config.vocab_size == 260 and config.num_layers == 2 and 64 <= config.hidden_size <= 128
