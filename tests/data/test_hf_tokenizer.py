"""The run's tokenizer: a Hugging Face tokenizer from local files, its defaults, errors and the vocab checks."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fastlm.data.config import HuggingFaceTokenizerConfig
from fastlm.data.hf_tokenizer import HuggingFaceTokenizer
from fastlm.data.tokenizer import ByteTokenizer, TokenizerError, build_tokenizer
from fastlm.run_config.checks import cross_check
from fastlm.run_config.schema import RunConfig
from tests.data.conftest import BPE_VOCAB

TEXTS = ["The cat sees the moon. 17+25=42.", "  spaces\tand\nnew lines ", "ünïcödé 日本語 🙂", ""]


@pytest.mark.parametrize("style", ["llama", "qwen2"])
def test_hf_tokenizer_matches_transformers(bpe_dir: Callable[[str], Path], style: str) -> None:
    directory = bpe_dir(style)
    tokenizer = build_tokenizer(HuggingFaceTokenizerConfig(path=str(directory)))
    reference = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert tokenizer.vocab_size == len(reference) == BPE_VOCAB
    assert tokenizer.eos_id == reference.eos_token_id and tokenizer.pad_id == reference.pad_token_id
    assert tokenizer.bos_id == (reference.bos_token_id if style == "llama" else None)
    for text in TEXTS:
        ids = tokenizer.encode(text, bos=True, eos=True)
        body = reference.encode(text, add_special_tokens=False)
        assert ids == ([tokenizer.bos_id] if style == "llama" else []) + body + [tokenizer.eos_id]
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode_batch(TEXTS, bos=True, eos=True) == [tokenizer.encode(t, bos=True, eos=True) for t in TEXTS]
    messages = [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}]
    assert tokenizer.render_chat(messages) == reference.apply_chat_template(messages, tokenize=False)


def test_fingerprint_is_stable_and_tells_tokenizers_apart(bpe_dir: Callable[[str], Path]) -> None:
    llama = [build_tokenizer(HuggingFaceTokenizerConfig(path=str(bpe_dir("llama")))).fingerprint for _ in range(2)]
    qwen = build_tokenizer(HuggingFaceTokenizerConfig(path=str(bpe_dir("qwen2")))).fingerprint
    assert llama[0] == llama[1] and len({llama[0], qwen, ByteTokenizer().fingerprint}) == 3


def test_default_is_the_init_checkpoint_tokenizer(bpe_dir: Callable[[str], Path], tmp_path: Path) -> None:
    assert isinstance(build_tokenizer(None, None), ByteTokenizer)
    assert isinstance(build_tokenizer(None, str(tmp_path)), ByteTokenizer)  # a checkpoint without tokenizer files
    shutil.copytree(bpe_dir("qwen2"), tmp_path / "ckpt")
    tokenizer = build_tokenizer(None, str(tmp_path / "ckpt"))
    assert isinstance(tokenizer, HuggingFaceTokenizer) and tokenizer.vocab_size == BPE_VOCAB


def test_missing_files_and_missing_eos_are_clear_errors(bpe_dir: Callable[[str], Path], tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"nope: tokenizer not found .*fix data.tokenizer.path"):
        build_tokenizer(HuggingFaceTokenizerConfig(path=str(tmp_path / "nope")))
    with pytest.raises(TokenizerError, match=r"no tokenizer files .*save_pretrained"):
        build_tokenizer(HuggingFaceTokenizerConfig(path=str(tmp_path)))
    broken = shutil.copytree(bpe_dir("qwen2"), tmp_path / "no_eos")
    settings = json.loads((broken / "tokenizer_config.json").read_text())
    settings["eos_token"] = None
    (broken / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(TokenizerError, match=r"no_eos: the tokenizer has no EOS token.*eos_token"):
        build_tokenizer(HuggingFaceTokenizerConfig(path=str(broken)))
    (broken / "tokenizer.json").write_text("{ truncated")
    with pytest.raises(TokenizerError, match=r"no_eos: could not load the tokenizer"):
        build_tokenizer(HuggingFaceTokenizerConfig(path=str(broken)))


def test_a_bare_tokenizer_json_needs_its_eos_named(bpe_dir: Callable[[str], Path]) -> None:
    path = str(bpe_dir("llama") / "tokenizer.json")
    with pytest.raises(TokenizerError, match="no EOS token"):
        build_tokenizer(HuggingFaceTokenizerConfig(path=path))
    tokenizer = build_tokenizer(HuggingFaceTokenizerConfig(path=path, eos_token="<|im_end|>"))
    assert tokenizer.eos_id == 1 and tokenizer.pad_id == 1 and tokenizer.bos_id is None


def _config(tokenizer: Path, vocab_size: int) -> RunConfig:
    return RunConfig.model_validate({"model": {"vocab_size": vocab_size},
                                     "data": {"tokenizer": {"type": "huggingface", "path": str(tokenizer)}}})


def test_model_vocab_must_cover_the_tokenizer(bpe_dir: Callable[[str], Path], tmp_path: Path) -> None:
    issues = cross_check(_config(bpe_dir("llama"), 300))
    assert [issue.path for issue in issues] == ["model.vocab_size"]
    assert "400 ids" in str(issues[0]) and "got 300" in str(issues[0]) and "at least 400" in str(issues[0])
    assert cross_check(_config(bpe_dir("llama"), 512)) == []  # padded up to a multiple of 128: fine
    missing = cross_check(_config(tmp_path / "gone", 512))
    assert [issue.path for issue in missing] == ["data.tokenizer"] and "gone" in str(missing[0])


def test_byte_tokenizer_exports_as_an_hf_tokenizer(tmp_path: Path) -> None:
    tokenizer = ByteTokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (256, 257, 258)
    for text in TEXTS:
        assert reloaded.encode(text, add_special_tokens=False) == tokenizer.encode(text)
        assert reloaded.decode(tokenizer.encode(text, bos=True, eos=True), skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tokenizer.render_chat(messages, add_generation_prompt=True)
