"""run.init_path starts a run from a fastlm run (SFT, then GRPO from it), a Hugging Face folder, or a hub name
found in a Hugging Face cache laid out as the hub writes it (built here: no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from fastlm.commands.main import main
from fastlm.config.errors import ConfigError
from fastlm.engine.init_path import resolve_init_path
from fastlm.engine.trainer import Trainer
from fastlm.models.hf import config_from_hf, model_yaml, read_hf_config
from fastlm.rl.objective import OnlineRLObjective
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = ["trainer.steps=2", "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.log_every=1",
         "data.source.num_documents=200", "logging.wandb.enabled=false", "logging.progress=false"]


def test_sft_in_fastlm_then_grpo_from_its_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """grpo.yaml's model trained with cross-entropy (the loss child swapped by type), then an RL run whose
    run.init_path is that run's folder: the policy starts from the SFT checkpoint's weights."""
    sft = load_config(CONFIGS / "grpo.yaml", ["rl=null", "model.head.losses.grpo={type: cross_entropy}", *SMALL,
                                              f"run.output_dir={tmp_path}/sft"])
    Trainer(sft).train()
    step_dir = tmp_path / "sft" / "checkpoints" / "step-00000002"
    rl_overrides = [f"run.init_path={tmp_path}/sft", "rl.warmup_steps=0", *SMALL, f"run.output_dir={tmp_path}/rl"]
    config = load_config(CONFIGS / "grpo.yaml", rl_overrides)
    assert config.run.init_path == str(step_dir.resolve())  # the run folder resolves to its latest checkpoint
    trainer = build_trainer(config)
    assert isinstance(trainer.objective, OnlineRLObjective)
    stored = load_file(str(step_dir / "model.safetensors"))
    for name, value in trainer.model.state_dict().items():
        if name in stored:
            assert torch.equal(value, stored[name]), name
    assert main(["validate", str(CONFIGS / "grpo.yaml"), *rl_overrides]) == 0
    capsys.readouterr()
    # another architecture than the checkpoint's is caught by validate, naming both values
    assert main(["validate", str(CONFIGS / "grpo.yaml"), *rl_overrides, "model.num_layers=3"]) == 2
    assert "run.init_path: its model differs from this run's (model.num_layers: checkpoint 2, this run 3)" in (
        capsys.readouterr().err)


def _hub_snapshot(cache: Path, repo: str) -> Path:
    """A tiny random Llama saved where the hub's cache keeps `repo` at main: refs/main names the snapshot."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = folder / "snapshots" / commit
    hf = transformers.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf).save_pretrained(str(snapshot))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_name_resolves_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv(variable, str(cache if variable == "HF_HUB_CACHE" else cache.parent))
    snapshot = _hub_snapshot(cache, "tiny-org/tiny-llama")
    assert resolve_init_path("tiny-org/tiny-llama").path == snapshot.resolve()
    config_file = tmp_path / "run.yaml"  # the model section `fastlm convert --from-hf` prints, a hub name in a YAML
    document = yaml.safe_load(model_yaml(config_from_hf(read_hf_config(snapshot))))
    document["run"] = {"init_path": "tiny-org/tiny-llama", "output_dir": str(tmp_path / "run")}
    document["data"] = {"seq_len": 32}
    config_file.write_text(yaml.safe_dump(document))
    config = load_config(config_file, ["trainer.steps=1", "logging.wandb.enabled=false"])
    assert config.run.init_path == str(snapshot.resolve())
    embedding = next(value for name, value in Trainer(config).model.state_dict().items() if "embed" in name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(snapshot)).model.embed_tokens.weight
    assert torch.equal(embedding, reference.detach())


def test_a_hub_name_neither_cached_nor_downloadable_names_the_cache(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "tiny.yaml", ["run.init_path=Qwen/Qwen3-0.6B"])
    text = str(caught.value)
    assert f"looked in {tmp_path / 'cache' / 'models--Qwen--Qwen3-0.6B'}" in text and "HF_HUB_OFFLINE is set" in text
    assert "huggingface-cli download Qwen/Qwen3-0.6B" in text and "from override `run.init_path=" in text
    with pytest.raises(ConfigError, match="neither a fastlm checkpoint .* nor a Hugging Face folder"):
        load_config(CONFIGS / "tiny.yaml", [f"run.init_path={tmp_path}"])
