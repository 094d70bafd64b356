"""The Qwen3.5 family beyond the shared family tests (test_families.py, test_moe_families.py): the presets'
counts against transformers' own on the meta device, the multimodal checkpoint's text tower, packed rows
against each document alone, multi-token-prediction tensors dropped, and generation with the recurrent
states: right padding, finished rows and multi-turn continuation against fresh generation, and on CUDA
the CUDA-graph decode step against eager decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fastlm.config.errors import ConfigError
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.generation.backend import NativeBackend
from fastlm.generation.generator import Generator
from fastlm.generation.sampling import SamplingOptions
from fastlm.models.build import num_parameters
from fastlm.models.hf import config_from_hf, import_hf
from tests.models.model_helpers import center_offset_norms, load_preset, randomize_weights

VOCAB = 260
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}


def _randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    randomize_weights(model, seed=seed)
    center_offset_norms(model)
    return model.eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    config = transformers.Qwen3_5TextConfig(**TEXT)
    config._attn_implementation = "eager"
    reference = _randomized(transformers.AutoModelForCausalLM.from_config(config), seed=5)
    directory = tmp_path_factory.mktemp("qwen3_5")
    reference.save_pretrained(directory)
    return reference, directory


@pytest.mark.parametrize(("preset", "config_class", "fields"), [
    ("qwen3.5-0.8b", "Qwen3_5TextConfig", {"hidden_size": 1024, "intermediate_size": 3584, "tie_word_embeddings": True}),
    ("qwen3.5-2b", "Qwen3_5TextConfig", {"hidden_size": 2048, "intermediate_size": 6144, "tie_word_embeddings": True}),
    ("qwen3.5-35b-a3b", "Qwen3_5MoeTextConfig", {
        "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "linear_num_value_heads": 32,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
        "num_experts_per_tok": 8, "tie_word_embeddings": False}),
])
def test_preset_counts_equal_transformers(preset: str, config_class: str, fields: dict) -> None:
    """The published config.json shapes built by transformers on the meta device: the same parameter count."""
    shape = {"vocab_size": 248320, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128}
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**{**shape, **fields}))
    theirs = sum(p.numel() for p in reference.parameters())
    print(f"{preset}: {num_parameters(load_preset(preset)):,} parameters, transformers {theirs:,}")
    assert num_parameters(load_preset(preset)) == theirs


def test_qwen1_5_moe_preset_count_equals_transformers() -> None:
    config = transformers.Qwen2MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                                         num_attention_heads=16, num_key_value_heads=16, moe_intermediate_size=1408,
                                         shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    assert num_parameters(load_preset("qwen1.5-moe-a2.7b")) == sum(p.numel() for p in reference.parameters())


def test_multimodal_checkpoint_imports_its_text_tower(tmp_path: Path) -> None:
    """A Qwen3_5ForConditionalGeneration folder (text_config, model.language_model.*, a vision tower, mrope
    parameters): the text tower comes in and its logits equal the multimodal model's on text."""
    text = transformers.Qwen3_5TextConfig(**TEXT, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
        "mrope_interleaved": True})
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
              "patch_size": 2, "spatial_merge_size": 1, "temporal_patch_size": 1}
    config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)
    config.text_config._attn_implementation = "eager"
    reference = _randomized(transformers.Qwen3_5ForConditionalGeneration(config), seed=8)
    reference.save_pretrained(tmp_path)
    model = import_hf(tmp_path).eval()
    assert model.config.type == "qwen3_5" and model.config.rope_theta == 1e7
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        error = float((model.logits(ids) - reference(input_ids=ids).logits).abs().max())
    print(f"multimodal qwen3_5 text tower: fp32 logits max abs err {error:.2e}")
    assert error <= 1e-5


def test_multi_token_prediction_tensors_are_dropped(folder: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    """A checkpoint with `mtp.*` tensors (the published ones carry one MTP layer) imports without them."""
    reference, directory = folder
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["mtp.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 48)
    tensors["mtp.fc.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(import_hf(tmp_path).eval().logits(ids), import_hf(directory).eval().logits(ids))


def test_packed_rows_equal_each_document_alone(folder: tuple[torch.nn.Module, Path]) -> None:
    """Float64: the linear layers restart state and conv window per document, attention is block-diagonal."""
    model = import_hf(folder[1]).double().eval()
    lengths = (5, 70, 4)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(6))
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model.logits(ids, documents)
        alone = torch.cat([model.logits(piece) for piece in ids.split(lengths, dim=1)], dim=1)
    error = float((packed - alone).abs().max())
    print(f"qwen3_5 packed vs one-by-one float64 max abs err {error:.2e}")
    assert error < 1e-10


@pytest.mark.parametrize(("field", "value"), [("attn_output_gate", False), ("attention_bias", True),
                                               ("hidden_act", "gelu")])
def test_unsupported_options_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_hf(transformers.Qwen3_5TextConfig(**TEXT).to_dict() | {field: value})
    assert any(issue.path == field for issue in caught.value.issues), caught.value.render()


PROMPTS = [[5, 17, 250, 3, 9, 44, 7], [101, 2, 33], [60, 61, 62, 63, 64]]


def test_right_padding_and_finished_rows_leave_other_rows_alone(folder: tuple[torch.nn.Module, Path]) -> None:
    """Right-padded prompts (a row's padding after its prompt is not part of its state) and stop tokens (a
    finished row is frozen) give each row the tokens it gets alone."""
    model = import_hf(folder[1]).double().eval()
    options = SamplingOptions(max_new_tokens=6, temperature=0.0)
    alone = [Generator(model, ByteTokenizer(), cuda_graph=False).generate([p], options)[0].tokens for p in PROMPTS]
    for padding in ("left", "right"):
        together = Generator(model, ByteTokenizer(), cuda_graph=False, padding=padding).generate(PROMPTS, options)
        assert [c.tokens for c in together] == alone, padding
    stop = alone[1][2]  # row 1 stops early at its third token
    stopping = SamplingOptions(max_new_tokens=6, temperature=0.0, stop_tokens=(stop,))
    together = Generator(model, ByteTokenizer(), cuda_graph=False).generate(PROMPTS, stopping)
    for row, completion in enumerate(together):
        cut = next((i + 1 for i, t in enumerate(alone[row]) if t == stop), len(alone[row]))
        assert completion.tokens == alone[row][:cut]


def test_multi_turn_continuation_equals_generating_the_whole_transcript(folder: tuple[torch.nn.Module, Path]) -> None:
    """Turn 2 continues the recurrent states and KV of turn 1 (row 0 stopped early in turn 1: its decode
    steps after the stop token changed nothing; row 1 left out after turn 1): its tokens equal a fresh
    generation from the whole transcript."""
    model = import_hf(folder[1]).double().eval()
    plain = SamplingOptions(max_new_tokens=4, temperature=0.0)
    stop = Generator(model, ByteTokenizer(), cuda_graph=False).generate(PROMPTS[:1], plain)[0].tokens[1]
    options = SamplingOptions(max_new_tokens=4, temperature=0.0, stop_tokens=(stop,))
    session = NativeBackend(model, ByteTokenizer(), padding="right").session(options, limit=40)
    first = session.start(PROMPTS)
    assert first[0].stopped and len(first[0].tokens) < 4
    replies = {0: [70, 71, 72], 2: [80]}
    second = session.extend(replies)
    fresh = Generator(model, ByteTokenizer(), cuda_graph=False)
    for row, reply in replies.items():
        transcript = PROMPTS[row] + first[row].tokens + reply
        assert second[row].tokens == fresh.generate([transcript], options)[0].tokens, row


def test_decode_step_traces_whole(folder: tuple[torch.nn.Module, Path]) -> None:
    """The decode step over recurrent states traces as one graph (`fullgraph=True`: what the compiled,
    CUDA-graph-captured step needs: no host read, no data-dependent Python), on static cache buffers, and
    gives the eager step's tokens (dynamo's eager backend: the trace, not inductor's code, is under test)."""
    model = import_hf(folder[1]).eval()
    options = SamplingOptions(max_new_tokens=6, temperature=0.0)
    expected = Generator(model, ByteTokenizer(), cuda_graph=False).generate(PROMPTS, options)
    engine = Generator(model, ByteTokenizer(), cuda_graph=False)
    width = max(map(len, PROMPTS))
    with torch.no_grad():
        step = engine._decode_step(model, None, len(PROMPTS), width + options.max_new_tokens - 1, options)
        for buffer in step.cache.buffers + step.state.buffers:
            torch._dynamo.mark_static_address(buffer)
        step.run = torch.compile(step.forward, fullgraph=True, dynamic=False, backend="eager")
        traced = engine._generate(model, None, step, PROMPTS, None, width)
    assert [c.tokens for c in traced] == [c.tokens for c in expected]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_equals_eager_decoding(folder: tuple[torch.nn.Module, Path]) -> None:
    """The captured decode step (static state buffers, fla prefill when installed) against eager fp32 decoding."""
    model = import_hf(folder[1]).cuda().eval()
    options = SamplingOptions(max_new_tokens=8, temperature=0.0)
    eager = Generator(model, ByteTokenizer(), cuda_graph=False).generate(PROMPTS, options)
    graph = Generator(model, ByteTokenizer(), cuda_graph=True).generate(PROMPTS, options)
    assert [c.tokens for c in graph] == [c.tokens for c in eager]
