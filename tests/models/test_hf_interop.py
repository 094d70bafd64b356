"""HF interop against transformers itself: tiny random models built locally with its config classes and
`save_pretrained` (no downloads), imported into fastlm, compared on logits / loss / gradients, exported
back and reloaded with identical weights; unsupported options fail naming the config.json field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers  # the `test` and `hf` extras
import yaml
from safetensors.torch import load_file, save_file

from fastlm.commands.main import main
from fastlm.config.errors import ConfigError
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.losses.spec import LossNormalizers, LossTargets
from fastlm.models.config import GPT2Config, LlamaConfig
from fastlm.models.decoder import build_model
from fastlm.models.hf import (
    check_matches,
    config_from_hf,
    export_hf,
    import_hf,
    load_hf_weights_into,
    to_hf_state,
    weight_rules,
)
from fastlm.run_config.loader import load_config
from tests.models.model_helpers import randomize_weights

VOCAB, SEQ = 300, 16
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}
GPT2_SMALL = {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32,
              "bos_token_id": 256, "eos_token_id": 257}
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {**SMALL, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "llama-tied": ("LlamaConfig", {**SMALL, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", SMALL),
    "qwen2-window": ("Qwen2Config", {**SMALL, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}),
    "mistral": ("MistralConfig", {**SMALL, "sliding_window": 6}),
    "gpt2": ("GPT2Config", GPT2_SMALL),
    "gpt2-untied": ("GPT2Config", {**GPT2_SMALL, "tie_word_embeddings": False}),
}
MODEL_CLASSES = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
                 "MistralConfig": "MistralForCausalLM", "GPT2Config": "GPT2LMHeadModel"}


def hf_model(kind: str, **overrides: Any) -> torch.nn.Module:
    config_name, fields = ARCHITECTURES[kind]
    config = getattr(transformers, config_name)(**{**fields, **overrides})
    config._attn_implementation = "eager"  # the mask (and window) are explicit in eager attention
    model = getattr(transformers, MODEL_CLASSES[config_name])(config).eval()
    randomize_weights(model, seed=sum(map(ord, kind)))
    return model


@pytest.fixture
def saved(tmp_path: Path) -> Callable[..., tuple[torch.nn.Module, Path]]:
    def make(kind: str, **overrides: Any) -> tuple[torch.nn.Module, Path]:
        model = hf_model(kind, **overrides)
        directory = tmp_path / f"hf-{kind}"
        model.save_pretrained(directory)
        return model, directory

    return make


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (2, SEQ) and shifted labels with some -100 positions."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[torch.rand(labels.shape, generator=generator) < 0.25] = -100
    return ids, labels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _reload(directory: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_import_matches_transformers_logits(kind: str, saved: Callable[..., tuple[torch.nn.Module, Path]]) -> None:
    reference, directory = saved(kind)
    model = import_hf(directory).eval()
    ids, _ = _inputs(seed=1)
    with torch.no_grad():
        ours, theirs = model.logits(ids), reference(ids).logits
    diff = float((ours - theirs).abs().max())
    print(f"{kind}: fp32 logits max abs diff {diff:.2e}, rel {_rel(ours, theirs):.2e}, "
          f"|logits| max {float(theirs.abs().max()):.2f}")
    assert diff < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2-window", "mistral", "gpt2-untied"])
def test_loss_and_gradients_match_in_float64(kind: str, saved: Callable[..., tuple[torch.nn.Module, Path]]) -> None:
    """Our CE head vs cross_entropy on transformers' float64 logits; every gradient mapped back to HF names.

    transformers' RMSNorm upcasts to float32 (not float64) and its RoPE tables are float32, so for the
    Llama family the float64 reference is only float32-accurate; GPT-2 (LayerNorm, no RoPE) is exact.
    """
    tolerance = 1e-12 if kind.startswith("gpt2") else 1e-5
    reference, directory = saved(kind)
    reference = reference.double()
    model = import_hf(directory).double().eval()
    ids, labels = _inputs(seed=2)
    flat = labels.reshape(-1)
    result = model(ids, LossTargets(labels=flat), LossNormalizers(tokens=float((flat != -100).sum())))
    result.loss.backward()
    logits = reference(ids).logits
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), flat, ignore_index=-100)
    expected.backward()
    loss, expected = result.loss.detach(), expected.detach()
    print(f"{kind}: float64 loss {float(loss):.6f} vs {float(expected):.6f}, rel {_rel(loss, expected):.2e}")
    assert abs(float(loss) - float(expected)) <= tolerance * abs(float(expected))
    grads = to_hf_state({name: p.grad for name, p in model.named_parameters()}, model.config)
    their_grads = {name: p.grad for name, p in reference.named_parameters()}
    assert set(grads) == set(their_grads)
    worst = max(_rel(grads[name], their_grads[name]) for name in grads)
    print(f"{kind}: worst gradient rel error over {len(grads)} tensors {worst:.2e}")
    assert worst < tolerance


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_export_reloads_with_identical_weights(kind: str, saved: Callable[..., tuple[torch.nn.Module, Path]],
                                               tmp_path: Path) -> None:
    reference, directory = saved(kind)
    exported = export_hf(import_hf(directory), tmp_path / "exported", ByteTokenizer())
    reloaded = _reload(exported)
    assert type(reloaded) is type(reference)
    original, again = reference.state_dict(), reloaded.state_dict()
    assert set(original) == set(again)
    for name, value in original.items():
        assert torch.equal(value, again[name]), name
    ids, _ = _inputs(seed=3)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, reference(ids).logits)


def test_sharded_bf16_checkpoint_imports(tmp_path: Path) -> None:
    """Several safetensors shards plus the index, stored in bf16: loaded and cast into the fp32 model."""
    reference = hf_model("qwen2").to(torch.bfloat16)
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    model = import_hf(tmp_path / "sharded")
    theirs = to_hf_state(model.state_dict(), model.config)
    assert all(value.dtype == torch.float32 for value in theirs.values())
    assert all(torch.equal(value, theirs[name].to(torch.bfloat16)) for name, value in reference.state_dict().items())
    exported = export_hf(model.to(torch.bfloat16), tmp_path / "bf16", ByteTokenizer())
    assert json.loads((exported / "config.json").read_text())["dtype"] == "bfloat16"


def test_mistral_window_is_exercised(saved: Callable[..., tuple[torch.nn.Module, Path]]) -> None:
    """SEQ > window and transformers' eager Mistral applies it: the logit comparison above covers the window."""
    windowed, directory = saved("mistral")
    full = hf_model("mistral", sliding_window=None)
    full.load_state_dict(windowed.state_dict())
    ids, _ = _inputs(seed=1)
    with torch.no_grad():
        gap = float((windowed(ids).logits - full(ids).logits).abs().max())
        ours_gap = float((import_hf(directory).eval().logits(ids) - full(ids).logits).abs().max())
    assert SEQ > 6 and gap > 1e-3 and ours_gap > 1e-3


@pytest.mark.parametrize("config", [
    LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=2, qkv_bias=True,
                sliding_window=5, rope_theta=1000.0),
    LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_heads=4, num_layers=2, sliding_window=7, tie_embeddings=True),
    GPT2Config(vocab_size=VOCAB, hidden_size=64, num_heads=4, num_layers=2, max_seq_len=32, intermediate_size=96),
], ids=["qwen2-window", "mistral-tied", "gpt2"])
def test_fastlm_model_exports_to_transformers(config: LlamaConfig | GPT2Config, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(config).eval()
    randomize_weights(model, seed=7)
    reloaded = _reload(export_hf(model, tmp_path / "out", ByteTokenizer()))
    check_matches(config, config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text())), "export")
    ids, _ = _inputs(seed=4)
    with torch.no_grad():
        ours, theirs = model.logits(ids), reloaded(ids).logits
    print(f"{config.type}: exported fp32 logits max abs diff {float((ours - theirs).abs().max()):.2e}")
    assert float((ours - theirs).abs().max()) < 1e-4


def test_rules_cover_every_fastlm_tensor() -> None:
    for config in (LlamaConfig(qkv_bias=True), LlamaConfig(tie_embeddings=True), GPT2Config(), GPT2Config(tie_embeddings=False)):
        assert {rule.ours for rule in weight_rules(config)} == set(build_model(config, "meta").state_dict())


def _hf_dict(kind: str, **overrides: Any) -> dict[str, Any]:
    config_name, fields = ARCHITECTURES[kind]
    return getattr(transformers, config_name)(**fields).to_dict() | overrides


@pytest.mark.parametrize(("kind", "overrides", "field"), [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"attention_dropout": 0.1}, "attention_dropout"),
    ("qwen2", {"layer_types": ["sliding_attention", "global"]}, "layer_types"),
    ("mistral", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("gpt2", {"activation_function": "relu"}, "activation_function"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"attn_pdrop": 0.0}, "attn_pdrop"),
    ("llama", {"model_type": "bert"}, "model_type"),
])
def test_unsupported_options_name_the_field(kind: str, overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_hf(_hf_dict(kind, **overrides))
    assert any(issue.path == field for issue in caught.value.issues), caught.value.render()
    print(caught.value.render())


def test_export_refuses_what_hf_cannot_express(tmp_path: Path) -> None:
    config = LlamaConfig(hidden_size=64, num_heads=4, dropout=0.1, head={"softcap": 30.0})
    with pytest.raises(ConfigError) as caught:
        export_hf(build_model(config, "meta"), tmp_path / "out", ByteTokenizer())
    assert {issue.path for issue in caught.value.issues} == {"model.dropout", "model.head.softcap"}
    assert not (tmp_path / "out").exists()


def test_mismatched_model_and_bad_tensors_are_named(saved: Callable[..., tuple[torch.nn.Module, Path]]) -> None:
    _, directory = saved("qwen2")
    wrong = build_model(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2,
                                    num_heads=4, num_kv_heads=4, norm_eps=1e-5, qkv_bias=True))
    with pytest.raises(ConfigError, match="model.num_kv_heads"):
        load_hf_weights_into(wrong, directory)
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    tensors["model.layers.0.extra.weight"] = torch.ones(2)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as caught:
        import_hf(directory)
    assert {issue.path for issue in caught.value.issues} == {
        "model.layers.1.self_attn.k_proj.bias", "model.layers.0.extra.weight"
    }


def test_cli_convert_both_ways(saved: Callable[..., tuple[torch.nn.Module, Path]], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    reference, directory = saved("mistral")
    assert main(["convert", "--from-hf", str(directory), "--to", str(tmp_path / "fastlm")]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["sliding_window"] == 6 and printed["run"]["init_path"] == str(directory.resolve())
    config = load_config(tmp_path / "fastlm" / "model.yaml")  # usable as a run config (or its base)
    model = build_model(config.model)
    load_hf_weights_into(model, config.run.init_path)
    assert main(["convert", "--from", str(tmp_path / "fastlm"), "--to-hf", str(tmp_path / "back")]) == 0
    again = _reload(tmp_path / "back").state_dict()
    assert all(torch.equal(value, again[name]) for name, value in reference.state_dict().items())
    broken = json.loads((directory / "config.json").read_text()) | {"hidden_act": "relu"}
    (directory / "config.json").write_text(json.dumps(broken))
    assert main(["convert", "--from-hf", str(directory)]) == 2
    assert "hidden_act: unsupported value" in capsys.readouterr().err


def test_training_round_trip_stays_loadable(saved: Callable[..., tuple[torch.nn.Module, Path]], tmp_path: Path) -> None:
    """HF checkpoint -> Trainer started from run.init_path (a few steps, real checkpoint) -> convert --to-hf
    -> transformers loads it and computes the trained model's logits."""
    from fastlm.engine.trainer import Trainer
    from fastlm.run_config.schema import RunConfig

    reference, directory = saved("qwen2")
    imported = config_from_hf(json.loads((directory / "config.json").read_text()))
    section = imported.model_dump(mode="json", exclude={"head"})
    config = RunConfig.model_validate({
        "run": {"name": "hf", "output_dir": str(tmp_path / "run"), "init_path": str(directory)},
        "model": {**section, "max_seq_len": SEQ},
        "data": {"source": {"type": "generated", "num_documents": 50}, "seq_len": SEQ, "micro_batch_size": 2},
        "trainer": {"steps": 3, "log_every": 1, "eval_every": 0, "checkpoint_every": 0},
        "logging": {"wandb": {"enabled": False}, "progress": False},
    })
    trainer = Trainer(config)
    started = to_hf_state(trainer.model.state_dict(), trainer.model.config)
    assert all(torch.equal(value, started[name]) for name, value in reference.state_dict().items())
    trainer.train()
    assert main(["convert", "--from", str(tmp_path / "run"), "--to-hf", str(tmp_path / "trained")]) == 0
    reloaded = _reload(tmp_path / "trained")
    moved = max(float((a - b).abs().max()) for a, b in zip(reference.state_dict().values(), reloaded.state_dict().values()))
    ids, _ = _inputs(seed=5)
    trainer.model.cpu().eval()  # the trainer's device is CUDA where there is one; the inputs are on the CPU
    with torch.no_grad():
        diff = float((trainer.model.logits(ids) - reloaded(ids).logits).abs().max())
    print(f"trained weights moved by up to {moved:.3e}; trained fastlm vs reloaded HF logits max abs diff {diff:.2e}")
    assert moved > 1e-4 and diff < 1e-4


def test_validate_checks_the_model_section_against_init_path(saved: Callable[..., tuple[torch.nn.Module, Path]],
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fastlm validate` fails before any work when run.init_path's architecture differs from the model."""
    _, directory = saved("mistral")
    assert main(["convert", "--from-hf", str(directory), "--to", str(tmp_path / "fastlm")]) == 0
    capsys.readouterr()
    model_yaml = tmp_path / "fastlm" / "model.yaml"
    assert main(["validate", str(model_yaml), "data.seq_len=16", "model.head.losses={cross_entropy: {}}"]) == 0
    capsys.readouterr()
    assert main(["validate", str(model_yaml), "data.seq_len=16", "model.num_layers=3"]) == 2
    err = capsys.readouterr().err
    assert "model.num_layers: does not match the checkpoint, which has 2" in err and "fastlm convert --from-hf" in err
    assert main(["validate", str(model_yaml), "data.seq_len=16", f"run.init_path={tmp_path / 'nowhere'}"]) == 2
    assert "run.init_path" in capsys.readouterr().err
