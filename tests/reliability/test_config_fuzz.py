"""Hostile configs: random YAML trees and override lists only ever give a `ConfigError` with a readable message.

Keys are drawn from the real schema (so the fuzzer reaches deep, validated fields) mixed with odd keys
(unicode, dots, ints, bools); values include huge numbers, NaN/inf, unicode and nested containers. The
same inputs go through `fastlm validate` (the CLI must answer 0 or 2, never a traceback).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from fastlm.commands.main import main
from fastlm.config.errors import ConfigError
from fastlm.run_config.loader import _unwrap, load_config
from fastlm.run_config.schema import RunConfig

FUZZ_EXAMPLES = int(os.environ.get("FASTLM_FUZZ_EXAMPLES", "120"))


def _schema_paths(model: type[BaseModel], prefix: str = "", depth: int = 0) -> list[str]:
    """Every dotted field path of the schema (through unions and dict values), so fuzzing reaches deep fields."""
    paths: list[str] = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        paths.append(dotted)
        if depth >= 4:
            continue
        for member in _unwrap(info.annotation):
            if isinstance(member, type) and issubclass(member, BaseModel):
                paths.extend(_schema_paths(member, dotted + ".", depth + 1))
    return sorted(set(paths))


SCHEMA_PATHS = _schema_paths(RunConfig)
SCHEMA_KEYS = sorted({part for path in SCHEMA_PATHS for part in path.split(".")} | {"type", "base", "cross_entropy",
                                                                                      "z_loss", "grpo", "gpt2"})

_odd_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
_key = st.one_of(st.sampled_from(SCHEMA_KEYS), _odd_text, st.integers(-3, 3), st.booleans())
# Integers are small or astronomically large: mid-range layer counts (10**5) are valid but slow to build
# on meta (minutes), which is a cost, not a crash (see docs/reliability.md).
_number = st.one_of(
    st.integers(-4, 4096),
    st.integers(min_value=2**62, max_value=10**40),
    st.integers(min_value=-(10**40), max_value=-(2**62)),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**300, 1e308, math.inf, -math.inf, math.nan]),
)
_leaf = st.one_of(st.none(), st.booleans(), _number, _odd_text,
                  st.sampled_from(["llama", "gpt2", "generated", "text", "jsonl", "bf16", "fp16", "cuda", "auto"]))
_tree = st.recursive(
    _leaf,
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(_key, children, max_size=4)),
    max_leaves=16,
)
_top = st.dictionaries(st.one_of(st.sampled_from([p.split(".")[0] for p in SCHEMA_PATHS] + ["base"]), _key), _tree,
                       max_size=5)
_override_key = st.one_of(st.sampled_from(SCHEMA_PATHS), _odd_text,
                          st.lists(st.one_of(st.sampled_from(SCHEMA_KEYS), _odd_text), min_size=1, max_size=7)
                          .map(".".join))
_override_value = st.one_of(_leaf.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...")
                                      .strip()), _odd_text, st.sampled_from(["[1, {a: 2}]", "{", "]", "!!python/none",
                                                                             "&a [*a]", "nan", ".inf", "1e999", "- x"]))
CONFIG_FILES = sorted(str(p.resolve()) for p in Path(__file__).parents[2].joinpath("configs").glob("*.yaml"))
_override = st.one_of(st.tuples(_override_key, _override_value).map("=".join), _odd_text)


def _write(directory: Path, tree: Any, raw: str | None) -> Path:
    path = directory / "fuzz.yaml"
    text = raw if raw is not None else yaml.safe_dump(tree, allow_unicode=True)
    path.write_text(text, encoding="utf-8")
    return path


def _check_error(error: ConfigError) -> None:
    """A readable error: at least one issue, every issue has a message, the rendering names them all."""
    assert error.issues, "ConfigError without issues"
    rendered = error.render()
    assert rendered.startswith("invalid configuration")
    for issue in error.issues:
        assert issue.message and str(issue) in rendered


FUZZ_SETTINGS = settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                          HealthCheck.data_too_large])


@FUZZ_SETTINGS
@given(tree=_top, overrides=st.lists(_override, max_size=4), raw=st.one_of(st.none(), _odd_text))
def test_load_config_only_raises_config_error(tmp_path_factory: pytest.TempPathFactory, tree: dict,
                                              overrides: list[str], raw: str | None) -> None:
    path = _write(tmp_path_factory.mktemp("fuzz"), tree, raw)
    try:
        config = load_config(path, overrides)
    except ConfigError as error:
        _check_error(error)
    else:
        assert isinstance(config, RunConfig)


@FUZZ_SETTINGS
@given(tree=_top, overrides=st.lists(_override, max_size=3))
def test_cli_validate_answers_0_or_2_without_traceback(tmp_path_factory: pytest.TempPathFactory, tree: dict,
                                                      overrides: list[str]) -> None:
    path = _write(tmp_path_factory.mktemp("fuzz"), tree, None)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["validate", str(path), *[f"--set={text}" for text in overrides]])
    if code == 0:
        assert "config OK" in stdout.getvalue()
    else:
        assert code == 2 and stderr.getvalue().startswith("invalid configuration"), stderr.getvalue()
        assert "Traceback" not in stderr.getvalue()


@FUZZ_SETTINGS
@given(base=st.sampled_from(CONFIG_FILES), overrides=st.lists(
    st.tuples(st.sampled_from(SCHEMA_PATHS), _override_value).map("=".join), min_size=1, max_size=3))
def test_mutated_real_configs_validate_or_name_the_field(tmp_path_factory: pytest.TempPathFactory, base: str,
                                                         overrides: list[str]) -> None:
    """Start from a shipped config (valid, so validation reaches the model build) and break up to three fields."""
    path = _write(tmp_path_factory.mktemp("fuzz"), {"base": base}, None)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["validate", str(path), *[f"--set={text}" for text in overrides]])
    assert code in (0, 2), stderr.getvalue()
    if code == 2:
        assert stderr.getvalue().startswith("invalid configuration") and "Traceback" not in stderr.getvalue()


@pytest.mark.parametrize("override", ["model.hidden_size=1000000000000", "model.vocab_size=100000000000000000000"])
def test_model_too_large_for_a_tensor_is_a_config_error(override: str) -> None:
    """Found by the fuzzer: these used to escape `fastlm validate` as a torch storage-overflow traceback."""
    with pytest.raises(ConfigError, match="more than a tensor can address") as caught:
        load_config(None, [override])
    assert "model.hidden_size" in str(caught.value) and override in str(caught.value)


@pytest.mark.parametrize("tree", [{".": {}}, {"model": {"a.b": 1}}, {"": {"steps": 2}}])
def test_dotted_or_empty_yaml_keys_are_config_errors(tmp_path: Path, tree: dict) -> None:
    """Found by the fuzzer: a key such as '.' crashed the merge with a KeyError."""
    with pytest.raises(ConfigError, match="keys must be non-empty and contain no '.'") as caught:
        load_config(_write(tmp_path, tree, None))
    assert str(tmp_path / "fuzz.yaml") in str(caught.value)
