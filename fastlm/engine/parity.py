"""`fastlm convert --from-hf DIR --check`: is the converted model the model transformers loads from DIR?

Four checks on random ids, one model in memory at a time (fastlm's, then transformers', then the export
reloaded in transformers): the largest logit difference, greedy generation token for token (fastlm's KV-cache
generator against transformers' `generate`), the export round trip (the exported tensors equal the checkpoint's
bit for bit, and transformers loads the export, without warnings, to the same logits) and the checkpoint's
parameters fastlm leaves unmapped. fp32 on CPU by default; `device="cuda"` runs both in bf16, where a greedy
divergence counts as a near tie (not a failure) when transformers' own logits of the two tokens differ by no
more than the logit tolerance.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastlm.data.tokenizer import build_tokenizer
from fastlm.generation.generator import Generator
from fastlm.generation.sampling import SamplingOptions
from fastlm.losses.spec import transform_logits
from fastlm.models.base import DecoderConfig
from fastlm.models.hf import export_hf, import_hf, read_hf_config, weight_files
from fastlm.models.registry import family_of

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25}  # max |logit difference| per dtype (--tolerance overrides)


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class ParityReport:
    directory: str
    model_type: str
    device: str
    dtype: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def table(self) -> str:
        """The report as a small aligned table, one line per check, then the verdict."""
        width = max(len(check.name) for check in self.checks)
        lines = [f"parity of {self.directory} ({self.model_type}, {self.device}, {self.dtype}) with transformers:"]
        lines += [f"  {check.name.ljust(width)}  {'ok  ' if check.passed else 'FAIL'}  {check.detail}"
                  for check in self.checks]
        lines.append("all checks passed" if self.passed else
                     f"{sum(not c.passed for c in self.checks)} of {len(self.checks)} checks failed")
        return "\n".join(lines)


@dataclass(frozen=True)
class _ModelVocab:
    """The generator's tokenizer interface over the model's whole vocab: the check compares the models,
    so greedy decoding may pick any id transformers may pick."""

    vocab_size: int
    pad_id: int | None = 0
    eos_id: int | None = None


def parity_report(directory: str | Path, device: str = "cpu", tokens: int = 256, new_tokens: int = 16,
                  tolerance: float | None = None, seed: int = 0) -> ParityReport:
    """Run the four checks on the HF checkpoint in `directory` (see the module docstring)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    directory = Path(directory)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    limit = TOLERANCE[dtype] if tolerance is None else tolerance
    report = ParityReport(str(directory), str(read_hf_config(directory).get("model_type")), device,
                          str(dtype).removeprefix("torch."))
    with tempfile.TemporaryDirectory(prefix="fastlm-check-") as folder:
        ours = _fastlm_side(directory, Path(folder), device, dtype, tokens, new_tokens, seed)
        reference = load_transformers(directory, device, dtype)[0]
        with torch.no_grad():
            theirs = reference(ours.ids).logits.float()
            expected = reference.generate(torch.tensor([ours.prompt], device=device), max_new_tokens=new_tokens,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ours.prompt):]
        difference = float((ours.logits - theirs).abs().max())
        report.checks.append(Check("logits", difference <= limit,
                                   f"max |difference| {difference:.2e} (tolerance {limit:.0e}, |logits| max "
                                   f"{float(theirs.abs().max()):.2f}, {ours.ids.shape[0]} x {ours.ids.shape[1]} "
                                   "random ids)"))
        report.checks.append(_greedy_check(reference, ours.prompt, ours.greedy, expected.tolist(), limit, device))
        del reference  # one model in memory at a time
        report.checks.append(_export_check(directory, ours.config, Path(folder), ours.ids, theirs, limit, device,
                                           dtype))
    report.checks.append(_unmapped_check(directory, ours.config, ours.mapped))
    return report


@dataclass
class _FastlmSide:
    config: DecoderConfig
    ids: torch.Tensor  # (2, tokens) random ids
    logits: torch.Tensor  # fastlm's, after the head's transform (what transformers returns), fp32
    prompt: list[int]
    greedy: list[int]
    mapped: set[str]  # the HF names fastlm's weight rules read (the tied output weight included)


def _fastlm_side(directory: Path, folder: Path, device: str, dtype: torch.dtype, tokens: int, new_tokens: int,
                 seed: int) -> _FastlmSide:
    """fastlm's model of `directory`: its logits and greedy tokens, and its export written to `folder`."""
    model = import_hf(directory, "cpu").to(device=device, dtype=dtype).eval()
    config = model.config
    length = min(tokens, config.max_seq_len)
    ids = torch.randint(0, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed)).to(device)
    prompt = ids[0, : max(1, min(32, config.max_seq_len - new_tokens))].tolist()
    with torch.no_grad():
        logits = transform_logits(model.logits(ids).float(), config.head.logit_scale, config.head.softcap)
    greedy = Generator(model, _ModelVocab(config.vocab_size), cuda_graph=False).generate(
        [prompt], SamplingOptions(max_new_tokens=new_tokens, temperature=0.0))[0].tokens
    export_hf(model, folder, build_tokenizer(None, str(directory)))
    mapped = {name for rule in family_of(config).hf.weight_rules(config) for name in rule.theirs}
    if config.tie_embeddings:
        mapped.add("lm_head.weight")
    return _FastlmSide(config, ids, logits, prompt, greedy, mapped)


def _unmapped_check(directory: Path, config: DecoderConfig, mapped: set[str]) -> Check:
    """The checkpoint's tensors no weight rule reads; those the family's import drops on purpose (a vision
    tower, saved rotary buffers) are counted apart."""
    adapter = family_of(config).hf
    names = set(_tensor_files(directory))
    renamed = adapter.normalise_keys({name: name for name in names})  # HF name as imported -> name in the file
    unmapped = sorted(original for name, original in renamed.items()
                      if name not in mapped and not name.endswith(adapter.ignored_suffixes))
    dropped = sorted(names - {original for name, original in renamed.items() if name in mapped} - set(unmapped))
    detail = "none" if not unmapped else f"{len(unmapped)}: {', '.join(unmapped[:6])}" + (" ..." * (len(unmapped) > 6))
    if dropped:
        detail += f" ({len(dropped)} left out by the family's import on purpose, e.g. {dropped[0]})"
    return Check("unmapped parameters", not unmapped, detail)


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Each tensor name of a safetensors checkpoint and the file holding it (headers only)."""
    from safetensors import safe_open

    files = {}
    for file in weight_files(directory):
        with safe_open(str(file), "pt") as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    return files


def _differs(exported: torch.Tensor, original: torch.Tensor) -> bool:
    return not torch.equal(exported, original.to(exported.dtype))


def _tensor(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as handle:
        return handle.get_tensor(name)


def load_transformers(directory: Path, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, list[str]]:
    """transformers' model of `directory` in eval mode, and the warnings its loading logged or raised."""
    import transformers

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage().strip().splitlines()[0])

    handler = Collect()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, dtype=dtype, attn_implementation="eager" if device == "cpu" else "sdpa")
    finally:
        logger.removeHandler(handler)
    records += [str(warning.message).splitlines()[0] for warning in caught]
    return model.to(device).eval(), records


def _greedy_check(reference: Any, prompt: list[int], ours: list[int], theirs: list[int], limit: float,
                  device: str) -> Check:
    """Equal token for token; else, at the first difference, a near tie when transformers' logits of its
    token and ours differ by at most `limit` (bf16 rounding may flip such a pick), a failure otherwise."""
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if agree is None:
        return Check("greedy generation", True, f"{len(ours)} of {len(theirs)} tokens equal (KV-cache decode)")
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + theirs[:agree]], device=device)).logits[0, -1].float()
    gap = float(logits[theirs[agree]] - logits[ours[agree]])
    tie = gap <= limit
    return Check("greedy generation", tie, f"first {agree} of {len(theirs)} tokens equal; token {agree}: fastlm "
                 f"{ours[agree]}, transformers {theirs[agree]}, logit gap {gap:.2e} "
                 + ("(a near tie within tolerance)" if tie else f"(more than the tolerance {limit:.0e})"))


def _export_check(directory: Path, config: DecoderConfig, exported: Path, ids: torch.Tensor,
                  reference_logits: torch.Tensor, limit: float, device: str, dtype: torch.dtype) -> Check:
    """The exported tensors against the checkpoint's (one pair in memory at a time), then transformers' logits
    of the export."""
    files = _tensor_files(directory)
    source = {name: (files[original], original) for name, original in  # a multimodal file's tensors by text names
              family_of(config).hf.normalise_keys({name: name for name in files}).items()}
    written = _tensor_files(exported)
    differing = sorted(name for name, file in written.items() if name not in source or _differs(
        _tensor(file, name), _tensor(*source[name])))
    reloaded, logged = load_transformers(exported, device, dtype)
    with torch.no_grad():
        difference = float((reloaded(ids).logits.float() - reference_logits).abs().max())
    problems = []
    if differing:
        problems.append(f"{len(differing)} tensors differ from the checkpoint's ({', '.join(differing[:3])})")
    if difference > limit:
        problems.append(f"logits differ by {difference:.2e}")
    if logged:
        problems.append(f"{len(logged)} warnings on loading: {logged[0]}")
    detail = "; ".join(problems) or (f"{len(written)} tensors equal, transformers reloads it without warnings, logits "
                                     f"max |difference| {difference:.2e}")
    return Check("export round trip", not problems, detail)
