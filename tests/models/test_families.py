"""Every model family and option against transformers, on tiny random models transformers builds here
(no downloads): logits (fp32, max abs err <= 1e-5), loss + one optimizer step, export then reload in
transformers, greedy generation with the KV cache token for token, and the CLI path convert -> train
(run.init_path) -> generate -> convert --to-hf for one folder per family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the `test` and `hf` extras

from fastlm.commands.main import main
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.engine.parity import load_transformers
from fastlm.generation.generator import Generator
from fastlm.generation.sampling import SamplingOptions
from fastlm.losses.spec import LossNormalizers, LossTargets, transform_logits
from fastlm.models.decoder import DecoderLM
from fastlm.models.hf import config_from_hf, export_hf, import_hf
from tests.models.model_helpers import center_offset_norms, randomize_weights, saved_pretrained

VOCAB, SEQ, WINDOW = 260, 12, 4  # the byte tokenizer's vocab: `fastlm generate` decodes what it samples
BASE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
SLIDING, FULL = "sliding_attention", "full_attention"
LINEAR_ATTENTION = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                    "linear_value_head_dim": 8}  # Qwen3.5's Gated DeltaNet layers (3 of its 4 layers)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama2": ("LlamaConfig", BASE),
    "llama3-rope-llama3-tied": ("LlamaConfig", {**BASE, "tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8, "rope_theta": 500000.0}}),
    "llama-rope-linear": ("LlamaConfig", {**BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 10000.0}}),
    "llama-rope-yarn": ("LlamaConfig", {**BASE, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}}),
    "llama-head-dim": ("LlamaConfig", {**BASE, "head_dim": 12}),
    "qwen2-mixed-windows": ("Qwen2Config", {**BASE, "use_sliding_window": True, "sliding_window": WINDOW,
                                            "max_window_layers": 1}),
    "mistral": ("MistralConfig", {**BASE, "sliding_window": WINDOW}),
    "qwen3": ("Qwen3Config", {**BASE, "head_dim": 16, "tie_word_embeddings": True}),
    "qwen3-mixed-windows": ("Qwen3Config", {**BASE, "head_dim": 8, "use_sliding_window": True,
                                            "sliding_window": WINDOW, "layer_types": [FULL, SLIDING]}),
    "gemma3": ("Gemma3TextConfig", {**BASE, "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 12,
                                    "sliding_window": WINDOW, "layer_types": [SLIDING, FULL, SLIDING],
                                    "rope_parameters": {FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                                        SLIDING: {"rope_type": "default", "rope_theta": 1e4}}}),
    "phi3": ("Phi3Config", {**BASE, "sliding_window": WINDOW, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}),
    "qwen3_5": ("Qwen3_5TextConfig", {**BASE, "num_hidden_layers": 4, "head_dim": 16, **LINEAR_ATTENTION}),
    "gemma2": ("Gemma2Config", {**BASE, "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 12,
                                "sliding_window": WINDOW, "attn_logit_softcapping": 1.0,
                                "final_logit_softcapping": 2.0}),
    "olmo2": ("Olmo2Config", BASE),
    "olmo3": ("Olmo3Config", {**BASE, "num_hidden_layers": 4, "sliding_window": WINDOW, "rope_parameters": {
        FULL: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4},
        SLIDING: {"rope_type": "default", "rope_theta": 5e3}}}),
    "granite": ("GraniteConfig", {**BASE, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.4, "logits_scaling": 2.5, "attention_dropout": 0.1}),
    "smollm3": ("SmolLM3Config", {**BASE, "num_hidden_layers": 4, "no_rope_layer_interval": 2,
                                  "use_sliding_window": True, "sliding_window": WINDOW,
                                  "layer_types": [SLIDING, FULL, FULL, SLIDING]}),
    "glm4": ("Glm4Config", {**BASE, "head_dim": 12, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                     "partial_rotary_factor": 0.5}}),
    "ministral": ("MinistralConfig", {**BASE, "head_dim": 8, "sliding_window": WINDOW, "layer_types": [SLIDING, FULL]}),
    "ministral3": ("Ministral3Config", {**BASE, "head_dim": 16, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}}),
    "gpt_oss": ("GptOssConfig", {**BASE, "num_hidden_layers": 3, "head_dim": 8, "sliding_window": WINDOW,
                                 "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 0.3,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 1e4,
                                                     "original_max_position_embeddings": 16}}),
    # no factor: transformers' max / original. The logits (SEQ 12 > 8) take the long factors; the 7-token prompt's
    # generation crosses the original context (the cache is recomputed there, as transformers' Phi-3 does)
    "phi3-longrope": ("Phi3Config", {**BASE, "original_max_position_embeddings": 8, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 1.7, 2.5],
        "long_factor": [1.5, 3.0, 6.0, 11.0]}}),
    # Phi-4-mini's shape: RoPE on the first 3/4 of each head (6 of 8 dims, 3 factors), longrope
    "phi3-partial-longrope": ("Phi3Config", {**BASE, "original_max_position_embeddings": 8, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "short_factor": [1.0, 1.4, 2.0],
        "long_factor": [2.0, 4.0, 9.0]}}),
    # MLA (full q_proj; q latent + yarn with mscale_all_dim + half-split rotary), first dense layer, 8 experts in
    # 4 groups of which 2 are kept, 2 shared experts, a random correction bias
    "deepseek_v3": ("DeepseekV3Config", {**BASE, "num_key_value_heads": 4, "num_hidden_layers": 3,
                                         "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
                                         "n_group": 4, "topk_group": 2, "moe_intermediate_size": 16,
                                         "n_shared_experts": 2, "kv_lora_rank": 16, "q_lora_rank": None,
                                         "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                                         "routed_scaling_factor": 2.5}),
    "deepseek_v3-q-lora-yarn": ("DeepseekV3Config", {
        **BASE, "num_key_value_heads": 4, "first_k_dense_replace": 0, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "moe_intermediate_size": 16, "n_shared_experts": 1, "kv_lora_rank": 16,
        "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "norm_topk_prob": False,
        "rope_interleave": False, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 16, "mscale": 1.0,
                                                      "mscale_all_dim": 0.8}}),
    # Gemma 4 (31B's shape): global layers with wider heads, one kv head, keys as values, proportional RoPE (4 of
    # 16 frequencies turn); a random layer_scalar per layer (hf_model); PLE, shared KV and MoE are refused
    "gemma4": ("Gemma4TextConfig", {**BASE, "num_hidden_layers": 3, "head_dim": 8, "global_head_dim": 32,
                                    "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": WINDOW,
                                    "layer_types": [SLIDING, FULL, FULL], "hidden_size_per_layer_input": 0,
                                    "final_logit_softcapping": 3.0}),
    # separate values and the sliding layers' kv heads on the global ones (no k = v), plain RoPE there
    # E2B / E4B's options: per-layer input embeddings (width 8), the last 2 of 5 layers attending over the last
    # earlier layer of their kind (3 and 4 over 1 and 2; no k/v projections of their own), double-wide MLPs there
    "gemma4-per-layer-inputs-shared-kv": ("Gemma4TextConfig", {
        **BASE, "num_hidden_layers": 5, "head_dim": 8, "global_head_dim": 16, "sliding_window": WINDOW,
        "layer_types": [SLIDING, SLIDING, FULL, SLIDING, FULL], "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
        "final_logit_softcapping": 3.0}),
    # 26B-A4B's MoE block: 4 GeGLU experts (top 2, scaled router, per-expert scales) beside the dense MLP
    "gemma4-moe": ("Gemma4TextConfig", {**BASE, "num_hidden_layers": 2, "head_dim": 8, "global_head_dim": 16,
                                        "num_global_key_value_heads": 1, "attention_k_eq_v": True,
                                        "sliding_window": WINDOW, "layer_types": [SLIDING, FULL],
                                        "hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": 4,
                                        "top_k_experts": 2, "moe_intermediate_size": 16}),
    "gemma4-values-full-rope": ("Gemma4TextConfig", {
        **BASE, "num_hidden_layers": 3, "head_dim": 8, "global_head_dim": 16, "sliding_window": WINDOW,
        "layer_types": [SLIDING, FULL, FULL], "hidden_size_per_layer_input": 0,
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                            FULL: {"rope_type": "default", "rope_theta": 1e5}}}),
    "gpt2": ("GPT2Config", {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
                            "bos_token_id": 256, "eos_token_id": 257}),
}
ONE_PER_FAMILY = ["llama3-rope-llama3-tied", "qwen2-mixed-windows", "mistral", "qwen3", "gemma3", "phi3", "gpt2",
                  "qwen3_5", "gemma2", "olmo3", "granite", "glm4", "gpt_oss",
                  "deepseek_v3", "gemma4"]  # ministral(3), smollm3: Llama's CLI path
FLEX_DECODE = ("gemma3", "gemma2", "gpt_oss", "deepseek_v3", "gemma4")
OFFSET_NORMS = ("Gemma3TextConfig", "Gemma2Config")  # (1 + w) norms: randomised around 0


def hf_model(case: str) -> torch.nn.Module:
    config_name, fields = CASES[case]
    config = getattr(transformers, config_name)(**fields)
    config._attn_implementation = "eager"  # the masks (and windows) are explicit in eager attention
    config._experts_implementation = "eager"  # a loop over experts: float64 too (the grouped kernel has none)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize_weights(model, seed=sum(map(ord, case)), norms_at_one=config_name not in OFFSET_NORMS)
    if case.startswith("qwen3_5"):
        center_offset_norms(model)
    with torch.no_grad():  # buffers that are weights: DeepSeek-V3's router correction bias, Gemma 4's layer scalars
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "layer_scalar")):
                noise = 0.1 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(len(name)))
                buffer.add_(noise) if name.endswith("layer_scalar") else buffer.copy_(noise)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each case's transformers model and its save_pretrained folder (built once for the module)."""
    return saved_pretrained(tmp_path_factory.mktemp, CASES, hf_model)


def _ids(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _reload(directory: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, folders: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    reference, directory = folders[case]
    model = import_hf(directory).eval()
    ids = _ids(seed=1)
    with torch.no_grad():  # what the softmax sees: the head's transform is part of some architectures (softcaps)
        ours, theirs = transform_logits(model.logits(ids), *model.config.head_transform()), reference(ids).logits
    error = float((ours - theirs).abs().max())
    print(f"{case}: fp32 logits max abs err {error:.2e} (|logits| max {float(theirs.abs().max()):.2f})")
    assert error <= 1e-5


def test_windows_and_rope_options_change_the_logits(folders: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    """The options above are exercised: without them fastlm's logits move (SEQ > window, positions > 8)."""
    ids = _ids(seed=1)
    for case, field, plain in (("qwen2-mixed-windows", "layer_types", None), ("gemma3", "layer_types", [FULL] * 3),
                               ("gemma2", "attn_logit_softcap", None), ("gemma2", "layer_types", [FULL] * 3),
                               ("olmo3", "layer_types", [FULL] * 4), ("olmo3", "rope_scaling", None),
                               ("granite", "residual_multiplier", 1.0), ("granite", "attention_multiplier", 1.0),
                               ("granite", "embedding_multiplier", 1.0), ("smollm3", "nope_layers", []),
                               ("glm4", "partial_rotary_factor", 1.0), ("ministral3", "query_scale_beta", 0.0),
                               ("gpt_oss", "layer_types", [FULL] * 3), ("gemma4", "partial_rotary_factor", 1.0),
                               ("gemma4", "sliding_window", 64),
                               ("llama3-rope-llama3-tied", "rope_scaling", None), ("llama-rope-yarn", "rope_scaling", None),
                               ("phi3-longrope", "rope_scaling", None)):
        model = import_hf(folders[case][1]).eval()
        changed = DecoderLM(model.config.model_copy(update={field: plain}))
        changed.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert float((model.logits(ids) - changed.eval().logits(ids)).abs().max()) > 1e-3, case


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_one_optimizer_step(case: str, folders: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    model = import_hf(folders[case][1]).train()
    ids = _ids(seed=2)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1).reshape(-1)
    labels[::5] = -100
    normalizers = LossNormalizers(tokens=float((labels != -100).sum()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(ids, LossTargets(labels=labels), normalizers).loss
    loss.backward()
    before = loss.detach()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    optimizer.step()
    with torch.no_grad():
        after = model(ids, LossTargets(labels=labels), normalizers).loss
    print(f"{case}: loss {float(before):.4f} -> {float(after):.4f} after one AdamW step")
    assert torch.isfinite(before) and float(after) < float(before)


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_loads_in_transformers_with_equal_logits(case: str, folders: dict[str, tuple[torch.nn.Module, Path]],
                                                        tmp_path: Path) -> None:
    reference, directory = folders[case]
    exported = export_hf(import_hf(directory), tmp_path / "exported", ByteTokenizer())
    reloaded, warned = load_transformers(exported, "cpu", torch.float32)
    assert not warned, warned  # e.g. RoPE keys transformers does not know for the rope_type
    assert type(reloaded) is type(reference)
    ids = _ids(seed=3)
    with torch.no_grad():
        error = float((reloaded(ids).logits - reference(ids).logits).abs().max())
    print(f"{case}: exported -> transformers logits max abs err {error:.2e}")
    assert error <= 1e-5
    again = config_from_hf(json.loads((exported / "config.json").read_text()))
    assert again.architecture() == import_hf(directory).config.architecture()


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generation_equals_transformers(case: str, folders: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    """Left-padded prompts of different lengths, past the window; float64 on both sides (no argmax ties).
    Gemma 3 (local + global layers), the score options (softcap, sinks) and DeepSeek-V3 (the latent cache) also
    decode through the FlexAttention
    decode masks (the CUDA-graph path's; eager FlexAttention on CPU is slow, so only there)."""
    reference, directory = folders[case]
    reference = reference.double()
    reference.generation_config.eos_token_id = None  # sample the whole budget, as ours does without stop tokens
    model = import_hf(directory).double().eval()
    prompts = [[5, 17, 250, 3, 9, 44, 7], [101, 2, 33]]
    options = SamplingOptions(max_new_tokens=5, temperature=0.0)
    for decode_attention in ("sdpa", "flex") if case in FLEX_DECODE else ("sdpa",):
        completions = Generator(model, ByteTokenizer(), cuda_graph=False, decode_attention=decode_attention).generate(
            prompts, options)
        for prompt, completion in zip(prompts, completions):
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert completion.tokens == expected[0, len(prompt):].tolist(), (case, decode_attention)


@pytest.mark.parametrize("case", ONE_PER_FAMILY)
def test_cli_convert_train_generate_export(case: str, folders: dict[str, tuple[torch.nn.Module, Path]],
                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, directory = folders[case]
    assert main(["convert", "--from-hf", str(directory), "--to", str(tmp_path / "fastlm")]) == 0
    run = tmp_path / "run"
    assert main(["train", str(tmp_path / "fastlm" / "model.yaml"), f"run.output_dir={run}", "run.name=families",
                 "data.seq_len=16", "data.micro_batch_size=2", "trainer.steps=2", "trainer.log_every=1",
                 "trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.wandb.enabled=false",
                 "logging.progress=false"]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0",
                 "--device", "cpu", "--jsonl"]) == 0
    generated = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(generated) == 1
    assert main(["convert", "--from", str(run), "--to-hf", str(tmp_path / "back")]) == 0
    assert type(_reload(tmp_path / "back")) is type(folders[case][0])


@pytest.mark.parametrize(("case", "overrides", "field"), [
    ("phi3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.rope_type"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.375}},
     "partial_rotary_factor"),  # 0.375 x head_dim 8: an odd rotary width (Phi-4-mini's 0.75 converts)
    ("phi3", {"resid_pdrop": 0.1}, "resid_pdrop"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("gemma3", {"rope_parameters": {FULL: {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                                    SLIDING: {"rope_type": "default", "rope_theta": 1e4}}},
     f"rope_parameters.{FULL}.rope_type"),
    ("gemma3", {"num_hidden_layers": 10**15, "layer_types": None}, "num_hidden_layers"),  # no 10^15-entry list
    ("gemma2", {"attention_bias": True}, "attention_bias"),
    ("olmo3", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
    ("granite", {"attention_dropout": "high"}, "attention_dropout"),
    ("granite", {"mlp_bias": True}, "mlp_bias"),
    ("smollm3", {"no_rope_layers": [1, 0, 1]}, "no_rope_layers"),
    ("gpt_oss", {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "quantization_config"),
    ("gpt_oss", {"attention_bias": False}, "attention_bias"),
    ("qwen2-mixed-windows", {"num_hidden_layers": 10**15, "layer_types": None}, "num_hidden_layers"),
    ("gemma4", {"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ("gemma4", {"layer_types": [SLIDING, FULL]}, "layer_types"),  # one entry short
    ("gemma4", {"rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 1e4}, FULL: {
        "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6, "factor": 8.0}}},
     f"rope_parameters.{FULL}.factor"),
])
def test_unsupported_options_name_the_field(case: str, overrides: dict[str, Any], field: str) -> None:
    from fastlm.config.errors import ConfigError

    config_name, fields = CASES[case]
    with pytest.raises(ConfigError) as caught:
        config_from_hf(getattr(transformers, config_name)(**fields).to_dict() | overrides)
    print(caught.value.render())
    assert any(issue.path == field for issue in caught.value.issues), caught.value.render()


@pytest.mark.parametrize("kind", ["dense", "flex"])
@pytest.mark.parametrize("case", ["gemma3", "deepseek_v3", "gemma4"])
def test_packed_documents_with_per_layer_windows(case: str, kind: str,
                                                 folders: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    """Training layouts (dense mask on CPU, FlexAttention block masks on GPU; eager FlexAttention here) with
    local and global layers (Gemma 3) or latent attention, whose values are narrower than its keys (DeepSeek-V3):
    a packed row equals its documents run one by one, in float64."""
    model = import_hf(folders[case][1]).double().eval()
    model.attention_kind = kind
    lengths = (5, 9, 4)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(6))
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model.logits(ids, documents)
        model.attention_kind = None
        alone = torch.cat([model.logits(piece) for piece in ids.split(lengths, dim=1)], dim=1)
    error = float((packed - alone).abs().max())
    print(f"{case} {kind} packed vs one-by-one float64 max abs err {error:.2e}")
    assert error < 1e-10


@pytest.mark.parametrize("rope", [{"rope_theta": 1e4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                     "original_max_position_embeddings": 16}},
                                  {"rope_theta": 1e4}, {}])
def test_olmo3_older_rope_keys_read_as_transformers_does(rope: dict[str, Any]) -> None:
    """An older OLMo 3 config.json (rope_theta, rope_scaling): transformers 5.25 gives them to the global
    layers and OLMo 3's default base (500000) to the sliding ones; fastlm's inverse frequencies equal its."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fastlm.layers.rotary import inverse_frequencies

    fields = {key: value for key, value in CASES["olmo3"][1].items() if key != "rope_parameters"}
    hf_config = transformers.Olmo3Config.from_dict({**fields, **rope})
    ours = config_from_hf({**fields, "model_type": "olmo3", **rope})
    for kind, theta, scaling in ((FULL, ours.rope_theta, ours.rope_scaling), (SLIDING, ours.rope_local_theta, None)):
        parameters = hf_config.rope_parameters[kind]
        if parameters["rope_type"] == "default":
            theirs = 1.0 / parameters["rope_theta"] ** (torch.arange(0, ours.head_dim, 2).float() / ours.head_dim)
        else:
            theirs = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](hf_config, "cpu", layer_type=kind)[0]
        assert torch.allclose(inverse_frequencies(ours.head_dim, theta, scaling), theirs, rtol=1e-6), kind


def test_rope_scaling_spellings_agree() -> None:
    """transformers 5's rope_parameters and the older rope_theta + rope_scaling give the same model."""
    new = CASES["llama3-rope-llama3-tied"][1]
    parameters = dict(new["rope_parameters"])
    theta = parameters.pop("rope_theta")
    old = {**transformers.LlamaConfig(**new).to_dict(), "rope_theta": theta, "rope_scaling": parameters}
    old.pop("rope_parameters")
    assert config_from_hf(old) == config_from_hf(transformers.LlamaConfig(**new).to_dict())
    assert config_from_hf(old).rope_scaling.type == "llama3"


def test_multimodal_gemma3_imports_its_text_tower(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration folder: its text_config and language-model tensors come in (the
    vision tower is left out), and the logits equal the multimodal model's on text."""
    _, fields = CASES["gemma3"]
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**fields).to_dict(),
                                       vision_config=vision.to_dict(), mm_tokens_per_image=4)
    config.text_config._attn_implementation = "eager"
    reference = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_weights(reference, seed=11)
    with torch.no_grad():  # the text tower's (1 + w) norms around 0 (randomize_weights drew every norm around 1)
        for name, parameter in reference.named_parameters():
            if "vision" not in name and parameter.ndim == 1 and "norm" in name:
                parameter.copy_(0.1 * torch.randn_like(parameter))
    reference.save_pretrained(tmp_path)
    model = import_hf(tmp_path).eval()
    assert model.config.type == "gemma3"
    ids = _ids(seed=7)
    with torch.no_grad():
        error = float((model.logits(ids) - reference(input_ids=ids).logits).abs().max())
    print(f"multimodal gemma3 text tower: fp32 logits max abs err {error:.2e}")
    assert error <= 1e-5


@pytest.mark.parametrize("case", ["qwen3", "gemma3", "llama-rope-yarn", "phi3", "gemma2", "granite", "glm4", "gpt_oss",
                                  "olmo3", "smollm3", "ministral3", "gemma4",
                                  "gemma4-per-layer-inputs-shared-kv", "gemma4-moe"])
def test_loss_and_gradients_match_transformers_in_float64(case: str,
                                                          folders: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    """Our CE vs cross_entropy on transformers' float64 logits, every gradient mapped back to HF names.
    transformers' norms and RoPE tables run in float32 even for float64 models, so 1e-5 is its accuracy."""
    import torch.nn.functional as F

    from fastlm.models.hf import to_hf_state

    directory = folders[case][1]
    reference = hf_model(case).double()  # the saved weights again (same seed): the fixture's model stays float32
    model = import_hf(directory).double().eval()
    ids = _ids(seed=8)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1).reshape(-1)
    labels[::4] = -100
    result = model(ids, LossTargets(labels=labels), LossNormalizers(tokens=float((labels != -100).sum())))
    result.loss.backward()
    expected = F.cross_entropy(reference(ids).logits.reshape(-1, VOCAB), labels, ignore_index=-100)
    expected.backward()
    stored = dict(model.named_buffers())  # constants in the state dict (Gemma 4's layer scalars): no gradient
    grads = to_hf_state({**stored, **{name: p.grad for name, p in model.named_parameters()}}, model.config)
    grads = {name: grad for name, grad in grads.items() if name not in dict(reference.named_buffers())}
    theirs = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert set(grads) == set(theirs)
    worst = max(float((grads[n] - theirs[n]).norm() / theirs[n].norm().clamp_min(1e-30)) for n in grads)
    loss_error = abs(float(result.loss) - float(expected)) / abs(float(expected))
    print(f"{case}: float64 loss rel err {loss_error:.2e}, worst gradient rel err over {len(grads)} tensors {worst:.2e}")
    assert loss_error < 1e-6 and worst < 1e-5


@pytest.mark.parametrize("case", ["llama3-rope-llama3-tied", "llama-rope-linear", "llama-rope-yarn", "phi3-longrope"])
def test_scaled_inverse_frequencies_equal_transformers(case: str) -> None:
    """Bit-equal to transformers' rope init (longrope: the short set, and the long one past the original
    context); longrope also against its float64 formula 1 / (factor_i * theta^(2i/d))."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fastlm.layers.rotary import inverse_frequencies

    config_name, fields = CASES[case]
    hf_config = getattr(transformers, config_name)(**fields)
    ours = config_from_hf(hf_config.to_dict())
    for long in (False, True) if case == "phi3-longrope" else (False,):
        theirs, factor = ROPE_INIT_FUNCTIONS[hf_config.rope_parameters["rope_type"]](
            hf_config, "cpu", seq_len=ours.rope_scaling.original_max_seq_len + 1 if long else None)
        frequencies = inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling, long=long)
        assert torch.equal(frequencies, theirs)
        assert ours.rope_scaling.cos_sin_scale == pytest.approx(factor, rel=1e-12)
        if case == "phi3-longrope":
            parameters = hf_config.rope_parameters
            divisors = torch.tensor(parameters["long_factor" if long else "short_factor"], dtype=torch.float64)
            exact = 1.0 / (divisors * 1e4 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
            error = float(((frequencies.double() - exact) / exact).abs().max())
            print(f"longrope {'long' if long else 'short'} factors: max rel err vs float64 {error:.1e}, "
                  f"cos/sin scale {factor:.6f}")
            assert error < 1e-6 and factor > 1


def test_head_takes_the_architectures_logit_transform(tmp_path: Path) -> None:
    """Gemma 2's final softcap is the head's softcap by default (so the loss, the sampler and the export see
    it); a head set to another one trains it, and the export refuses it, naming the field."""
    from fastlm.config.errors import ConfigError
    from fastlm.models.gemma2.config import Gemma2Config

    assert Gemma2Config().head.softcap == 30.0
    assert Gemma2Config(final_logit_softcap=None).head.softcap is None
    other = Gemma2Config(hidden_size=32, num_heads=2, head={"softcap": 20.0})
    assert other.head.softcap == 20.0
    with pytest.raises(ConfigError) as caught:
        export_hf(DecoderLM(other), tmp_path, ByteTokenizer())
    assert [issue.path for issue in caught.value.issues] == ["model.head.softcap"]


def test_glm4_peft_export_of_permuted_rows_is_refused(folders: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    """GLM-4's q/k rows are stored in another order than fastlm's (interleaved rotary pairs): PEFT adapters on
    them would land on the wrong rows, so the PEFT export names the module and the way out; others export."""
    from fastlm.lora.attach import select_targets
    from fastlm.lora.peft import PeftFormatError, hf_layout

    model = import_hf(folders["glm4"][1])
    with pytest.raises(PeftFormatError, match=r"blocks.0.attn.qkv_proj \(q\)"):
        hf_layout(model.config, select_targets(model, ["attn.q"]))
    assert hf_layout(model.config, select_targets(model, ["mlp.down", "attn.v"]))[0] == "lm_head"


def test_gpt_oss_mxfp4_checkpoint_is_dequantised_at_import(tmp_path: Path) -> None:
    """A GPT-OSS folder whose experts are MXFP4 (`*_blocks` / `*_scales`, `quantization_config`, as the
    published ones): fastlm's dequantisation equals transformers' bit for bit, and the imported model's logits
    equal transformers' model holding those dequantised weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from fastlm.models.gpt_oss.hf import dequantized_mxfp4

    _, fields = CASES["gpt_oss"]
    config = transformers.GptOssConfig(**{**fields, "intermediate_size": 64})  # MXFP4 blocks: widths of 32
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize_weights(reference, seed=12)
    generator = torch.Generator().manual_seed(13)
    quantized = {}
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                experts, columns, rows = parameter.shape  # (E, in, out): the blocks run over `in`
                blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), dtype=torch.uint8, generator=generator)
                scales = torch.randint(120, 130, (experts, rows, columns // 32), dtype=torch.uint8, generator=generator)
                theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
                ours = dequantized_mxfp4({f"{name}_blocks": blocks, f"{name}_scales": scales})[name]
                assert torch.equal(ours, theirs), name
                parameter.copy_(theirs.float())
                quantized.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
    reference.save_pretrained(tmp_path / "dequantised")
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    hf_config = json.loads((tmp_path / "dequantised" / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    (folder / "config.json").write_text(json.dumps(hf_config))
    tensors = load_file(tmp_path / "dequantised" / "model.safetensors")
    tensors = {name: value for name, value in tensors.items() if f"{name}_blocks" not in quantized}
    assert len(tensors) == len(load_file(tmp_path / "dequantised" / "model.safetensors")) - len(quantized) // 2
    save_file({**tensors, **quantized}, folder / "model.safetensors")
    model = import_hf(folder).eval()
    ids = _ids(seed=14)
    with torch.no_grad():
        error = float((model.logits(ids) - reference(ids).logits).abs().max())
    print(f"gpt_oss from MXFP4: fp32 logits max abs err {error:.2e}")
    assert error <= 1e-5


@pytest.mark.parametrize("padding", ["left", "right"])
def test_longrope_generation_across_the_original_context(padding: str,
                                                         folders: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    """Prompts that cross the original context (8) mid-generation, stay below it, or start past it, batched and
    padded either way: token for token with transformers' Phi-3 `generate`, which recomputes its cache where a
    sequence crosses (fastlm: `Generator._rebuild_step`; a right-padded prefill's padding does not count)."""
    reference, directory = folders["phi3-longrope"]
    reference = reference.double()
    reference.generation_config.eos_token_id = None
    model = import_hf(directory).double().eval()
    prompts = [[5, 17, 250, 3, 9, 44, 7], [101, 2, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False, pad_token_id=0)[0, len(p):]
                .tolist() for p in prompts]
    completions = Generator(model, ByteTokenizer(), cuda_graph=False, padding=padding).generate(
        prompts, SamplingOptions(max_new_tokens=7, temperature=0.0))
    assert [completion.tokens for completion in completions] == expected


def test_deepseek_multi_token_prediction_layers_are_dropped(folders: dict[str, tuple[torch.nn.Module, Path]],
                                                            tmp_path: Path) -> None:
    """DeepSeek-V3 checkpoints carry their MTP module as one more layer (eh_proj, enorm, hnorm and a full block):
    the import leaves that layer out, as transformers does, and the logits are the main model's."""
    import shutil

    from safetensors.torch import load_file, save_file

    reference, directory = folders["deepseek_v3"]
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    mtp = {f"model.layers.3.{name}": torch.randn(shape) for name, shape in (
        ("eh_proj.weight", (32, 64)), ("enorm.weight", (32,)), ("hnorm.weight", (32,)),
        ("input_layernorm.weight", (32,)), ("self_attn.q_proj.weight", (64, 32)))}
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = import_hf(tmp_path).eval()
    ids = _ids(seed=9)
    with torch.no_grad():
        assert float((model.logits(ids) - reference(ids).logits).abs().max()) <= 1e-5
    assert len(model.blocks) == 3
