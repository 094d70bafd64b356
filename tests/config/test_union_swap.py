"""A layer that gives a union section another `type:` replaces the section: the old variant's keys do not
leak into the new one (from an override, a child YAML's `base:`, or a `section.type=` leaf override)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from fastlm.config.errors import ConfigError
from fastlm.data.config import ByteTokenizerConfig, TextSource
from fastlm.generation.backend_config import TransformersBackendConfig
from fastlm.losses.children import CISPOConfig
from fastlm.models.config import GPT2Config
from fastlm.rl.config import ReverseTaskConfig
from fastlm.run_config.loader import _unwrap, load_config, load_layers, variant_tags
from fastlm.run_config.schema import RunConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STORY = "Once upon a time a tiny model read a story, one byte at a time, and liked it.\n" * 400

# every union section of the schema ('*' is an entry of a dict of variants), and the test that swaps it
UNION_TESTS = {
    "model": "test_model_type_swap",
    "model.head.losses.*": "test_loss_child_swap",
    "data.source": "test_data_source_swap_from_the_command_line",
    "data.tokenizer": "test_tokenizer_swap",
    "rl.task": "test_rl_task_swap",
    "rl.prompts": "test_rl_prompts_is_replaced_and_null_clears_it",
    "optimizer": "test_single_variant_section_merges",
    "data.eval_source": "test_eval_source_swap",
    "rl.eval_prompts": "test_rl_eval_prompts_swaps_between_a_count_and_a_file",
    "rl.backend": "test_rl_backend_swap",
}


def _union_paths(annotation: typing.Any, prefix: str, seen: set[type]) -> list[str]:
    """Dotted paths of every section whose annotation has `type:`-tagged variants (walks the schema)."""
    found = [prefix] if prefix and variant_tags(annotation) else []
    for member in _unwrap(annotation):
        if typing.get_origin(member) is dict:
            found += _union_paths(typing.get_args(member)[1], f"{prefix}.*", seen)
        elif isinstance(member, type) and issubclass(member, BaseModel) and member not in seen:
            seen.add(member)
            for name, field in member.model_fields.items():
                found += _union_paths(field.annotation, f"{prefix}.{name}".strip("."), seen)
    return found


def test_every_union_of_the_schema_has_a_swap_test() -> None:
    found = sorted(set(_union_paths(RunConfig, "", set())))
    assert found == sorted(UNION_TESTS), f"union sections without a swap test: {found}"
    assert all(name in globals() for name in UNION_TESTS.values())


def test_data_source_swap_from_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's command: tiny.yaml's generated source (num_documents) swapped for a text file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "story.txt").write_text(STORY)
    config = load_config(CONFIGS / "tiny.yaml", ["data.source={type: text, path: story.txt}"])
    assert isinstance(config.data.source, TextSource) and config.data.source.path == "story.txt"
    # two leaf overrides do the same: `type=` clears the old variant's keys, `path=` adds the new one's
    config = load_config(CONFIGS / "tiny.yaml", ["data.source.type=text", "data.source.path=story.txt"])
    assert isinstance(config.data.source, TextSource)
    # a same-type override still deep-merges
    layers = load_layers(CONFIGS / "tiny.yaml", ["data.source={type: generated, seed: 3}"])
    assert layers.data["data"]["source"] == {"type": "generated", "num_documents": 4000, "seed": 3}


def test_data_source_swap_in_a_child_yaml(tmp_path: Path) -> None:
    (tmp_path / "story.txt").write_text(STORY)
    child = tmp_path / "mine.yaml"
    child.write_text(yaml.safe_dump({"base": str(CONFIGS / "tiny.yaml"), "data": {"source": {"type": "text",
                                     "path": "story.txt"}}}))
    config = load_config(child)
    assert config.data.source.path == str(tmp_path / "story.txt")
    # the section's source is the child now: a missing key of the new variant names it, not tiny.yaml
    child.write_text(yaml.safe_dump({"base": str(CONFIGS / "tiny.yaml"), "data": {"source": {"type": "text"}}}))
    with pytest.raises(ConfigError) as caught:
        load_config(child)
    assert "data.source.path: required key is missing" in str(caught.value) and "mine.yaml" in str(caught.value)
    assert "num_documents" not in str(caught.value)


def test_model_type_swap() -> None:
    """tiny-llama's preset sets rope_theta and num_kv_heads (llama only); gpt2 replaces the whole section."""
    config = load_config(CONFIGS / "tiny.yaml", ["model={type: gpt2, vocab_size: 260, hidden_size: 64, num_heads: 4}"])
    assert isinstance(config.model, GPT2Config) and config.model.hidden_size == 64


def test_loss_child_swap(tmp_path: Path) -> None:
    """A loss child named `grpo` in grpo.yaml (eps_low: grpo only) swapped for cispo; a name-implied type counts."""
    config = load_config(CONFIGS / "grpo.yaml", ["model.head.losses.grpo={type: cispo}"])
    assert isinstance(config.model.head.losses["grpo"], CISPOConfig)
    layers = load_layers(None, ["model.head.losses.z_loss={weight: 0.1}", "model.head.losses.z_loss={type: cross_entropy}"])
    assert layers.data["model"]["head"]["losses"]["z_loss"] == {"type": "cross_entropy"}


def test_tokenizer_swap(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"data": {"tokenizer": {"type": "huggingface", "path": "no-such-tokenizer"}}}))
    config = load_config(base, ["data.tokenizer={type: byte}"])
    assert isinstance(config.data.tokenizer, ByteTokenizerConfig)


def test_rl_task_swap() -> None:
    config = load_config(CONFIGS / "grpo.yaml", ["rl.task={type: reverse, length: 2}"])
    assert isinstance(config.rl.task, ReverseTaskConfig) and config.rl.task.length == 2


def test_rl_backend_swap() -> None:
    """A native backend's knob (decode_slots) does not leak into the transformers backend that replaces it."""
    config = load_config(CONFIGS / "grpo.yaml", ["rl.backend.decode_slots=8", "rl.backend.type=transformers"])
    assert isinstance(config.rl.backend, TransformersBackendConfig)
    assert "decode_slots" not in config.rl.backend.model_dump()


def test_rl_prompts_is_replaced_and_null_clears_it(tmp_path: Path) -> None:
    """rl.prompts has one variant (jsonl): a same-type layer merges, and `null` turns it off (the task again)."""
    layers = load_layers(None, ["rl.prompts={path: a.jsonl, prompt_field: q}", "rl.prompts={type: jsonl, path: b.jsonl}"])
    assert layers.data["rl"]["prompts"] == {"path": "b.jsonl", "prompt_field": "q", "type": "jsonl"}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')
    config = load_config(CONFIGS / "grpo.yaml", [f"rl.prompts={{path: {prompts}}}", "rl.prompts=null"])
    assert config.rl.prompts is None


def test_rl_eval_prompts_swaps_between_a_count_and_a_file(tmp_path: Path) -> None:
    """rl.eval_prompts is a count, a fraction or a JSONL (type jsonl): a file replaces a count and a count a file,
    with none of the file's keys left behind."""
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"q": "1+1="}\n')
    config = load_config(CONFIGS / "grpo.yaml", [f"rl.eval_prompts={{path: {prompts}, prompt_field: q}}"])
    assert (config.rl.eval_prompts.path, config.rl.eval_prompts.prompt_field) == (str(prompts), "q")
    config = load_config(CONFIGS / "grpo.yaml", [f"rl.eval_prompts={{path: {prompts}, prompt_field: q}}", "rl.eval_prompts=8"])
    assert config.rl.eval_prompts == 8


def test_single_variant_section_merges() -> None:
    """optimizer has one variant (adamw): naming its type keeps the YAML's other keys."""
    config = load_config(CONFIGS / "tiny.yaml", ["optimizer={type: adamw, eps: 1.0e-6}"])
    assert (config.optimizer.lr, config.optimizer.eps) == (3.0e-3, 1.0e-6)


def test_eval_source_swap() -> None:
    layers = load_layers(None, ["data.eval_source={type: text, path: a.txt}", "data.eval_source={type: generated, seed: 7}"])
    assert layers.data["data"]["eval_source"] == {"type": "generated", "seed": 7}
