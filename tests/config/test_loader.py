"""Layered config resolution and its error messages, on real YAML files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fastlm.config.errors import ConfigError
from fastlm.losses.children import GRPOConfig, ZLossConfig
from fastlm.models.config import GPT2Config, LlamaConfig
from fastlm.run_config.loader import dump_config, load_config, load_layers, parse_override


def write(path: Path, data: dict | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data), encoding="utf-8")
    return path


def test_defaults_then_yaml_then_overrides(tmp_path: Path) -> None:
    config_file = write(tmp_path / "run.yaml", {"model": {"type": "llama", "hidden_size": 64}, "trainer": {"steps": 7}})
    config = load_config(config_file, ["model.hidden_size=96", "optimizer.betas=[0.8, 0.9]"])
    assert config.model.hidden_size == 96  # override beats YAML
    assert config.trainer.steps == 7  # YAML beats default
    assert config.trainer.log_every == 10  # default
    assert config.optimizer.betas == (0.8, 0.9)  # override values are YAML


def test_base_inheritance_deep_merges_and_resolves_relative_paths(tmp_path: Path) -> None:
    write(tmp_path / "presets" / "model.yaml", {"model": {"type": "gpt2", "hidden_size": 48, "num_heads": 4}})
    write(tmp_path / "presets" / "data.yaml", {"data": {"source": {"type": "text", "path": "corpus.txt"}}})
    child = write(
        tmp_path / "exp" / "child.yaml",
        {"base": ["../presets/model.yaml", "../presets/data.yaml"], "model": {"num_layers": 3}},
    )
    config = load_config(child)
    assert isinstance(config.model, GPT2Config)
    assert (config.model.hidden_size, config.model.num_layers) == (48, 3)
    assert config.data.source.path == str((tmp_path / "presets" / "corpus.txt").resolve())


def test_base_cycle_is_an_error(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", {"base": "b.yaml"})
    write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_unknown_key_suggests_the_close_name_and_names_the_file(tmp_path: Path) -> None:
    config_file = write(tmp_path / "bad.yaml", {"model": {"type": "llama", "hiden_size": 64}})
    with pytest.raises(ConfigError) as caught:
        load_config(config_file)
    text = str(caught.value)
    assert "model.hiden_size: unknown key" in text
    assert "did you mean 'hidden_size'" in text
    assert str(config_file.resolve()) in text


def test_every_issue_names_path_value_and_source(tmp_path: Path) -> None:
    config_file = write(
        tmp_path / "bad.yaml",
        {"optimizer": {"lr": -1}, "model": {"type": "llama", "head": {"losses": {"z": {"type": "z_los"}}}}},
    )
    with pytest.raises(ConfigError) as caught:
        load_config(config_file, ["trainer.steps=many"])
    by_path = {issue.path: issue for issue in caught.value.issues}
    assert by_path["optimizer.lr"].value == -1 and by_path["optimizer.lr"].source == str(config_file.resolve())
    assert by_path["trainer.steps"].source == "override `trainer.steps=many`"
    assert by_path["model.head.losses.z.type"].value == "z_los"
    assert "z_loss" in by_path["model.head.losses.z.type"].hint
    print(caught.value)


def test_discriminated_losses_and_models(tmp_path: Path) -> None:
    config_file = write(
        tmp_path / "rl.yaml",
        {"model": {"type": "llama", "num_kv_heads": 2,
                   "head": {"losses": {"policy": {"type": "grpo", "eps_high": 0.28}, "z": {"type": "z_loss"}}}}},
    )
    config = load_config(config_file)
    assert isinstance(config.model, LlamaConfig)
    assert isinstance(config.model.head.losses["policy"], GRPOConfig)
    assert isinstance(config.model.head.losses["z"], ZLossConfig)


@pytest.mark.parametrize(
    ("losses", "message"),
    [
        ({"a": {"type": "cross_entropy"}, "b": {"type": "cross_entropy"}}, "both of type 'cross_entropy'"),
        ({"d": {"type": "dpo"}, "ce": {"type": "cross_entropy"}}, "dpo"),
        ({}, "at least one loss"),
    ],
)
def test_head_composition_rules(tmp_path: Path, losses: dict, message: str) -> None:
    config_file = write(tmp_path / "c.yaml", {"model": {"type": "llama", "head": {"losses": losses}}})
    with pytest.raises(ConfigError, match=message):
        load_config(config_file)


def test_use_triton_true_rejects_children_without_a_kernel(tmp_path: Path) -> None:
    config_file = write(tmp_path / "c.yaml", {"model": {"type": "llama", "head": {
        "use_triton": True, "losses": {"pref": {"type": "dpo"}}}}})
    with pytest.raises(ConfigError, match=r"no path for \['pref \(dpo\)'\]"):
        load_config(config_file)


def test_cross_section_checks_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["data.seq_len=4096"])
    assert caught.value.issues[0].path == "data.seq_len"
    assert caught.value.issues[0].source == "override `data.seq_len=4096`"


@pytest.mark.parametrize("text", ["novalue", "=3", "a..b=1", "a.b=[unclosed"])
def test_malformed_overrides(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_override(text)


def test_override_can_replace_a_whole_section_variant(tmp_path: Path) -> None:
    config_file = write(tmp_path / "c.yaml", {"model": {"type": "llama", "hidden_size": 64}})
    config = load_config(config_file, ["model={type: gpt2, hidden_size: 32, num_heads: 2}"])
    assert isinstance(config.model, GPT2Config) and config.model.hidden_size == 32


def test_unsafe_yaml_is_refused(tmp_path: Path) -> None:
    config_file = write(tmp_path / "evil.yaml", "model: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(config_file)


def test_print_config_round_trips(tmp_path: Path) -> None:
    config = load_config(None, ["model.hidden_size=96"])
    dumped = write(tmp_path / "dumped.yaml", dump_config(config))
    assert load_config(dumped) == config


def test_provenance_tracks_the_last_layer(tmp_path: Path) -> None:
    base = write(tmp_path / "base.yaml", {"trainer": {"steps": 3, "log_every": 2}})
    child = write(tmp_path / "child.yaml", {"base": "base.yaml", "trainer": {"steps": 5}})
    layered = load_layers(child, ["trainer.log_every=1"])
    assert layered.source_of("trainer.steps") == str(child.resolve())
    assert layered.source_of("trainer.log_every") == "override `trainer.log_every=1`"
    assert layered.source_of("optimizer.lr") == "defaults"
    assert str(base) != str(child)


_yaml_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=6))
_yaml_tree = st.recursive(
    _yaml_leaf,
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.sampled_from(["model", "type", "hidden_size", "losses", "trainer",
                                                                "steps", "x", "head", "data", "lr"]), children, max_size=3)),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(tree=st.dictionaries(st.sampled_from(["model", "trainer", "data", "optimizer", "run", "bogus"]), _yaml_tree,
                            max_size=4))
def test_fuzzed_configs_only_raise_config_errors(tmp_path_factory: pytest.TempPathFactory, tree: dict) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(yaml.safe_dump(tree), encoding="utf-8")
    try:
        load_config(path)
    except ConfigError as error:
        assert error.issues and all(issue.message for issue in error.issues)


def test_type_defaults_and_loss_names_as_types(tmp_path: Path) -> None:
    config_file = write(tmp_path / "c.yaml", {"model": {"hidden_size": 64, "head": {"losses": {"cross_entropy": {},
                                                                                              "z_loss": {"weight": 0.01}}}},
                                              "data": {"source": {"num_documents": 10}}})
    config = load_config(config_file)
    assert isinstance(config.model, LlamaConfig)
    assert config.model.head.losses["z_loss"].weight == 0.01
    assert config.data.source.type == "generated" and config.data.source.num_documents == 10
