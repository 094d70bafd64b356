"""The training loops the benchmarks time: fastlm's model + head + optimizer step on synthetic batches (`Loop`),
transformers' model with a loss (`HFLoop`), the batches, the variants, and the measured peak FLOP/s.

A leaf of tools/: bench_train.py, bench_lora.py, bench_long.py and compare_cli.py import it, and it imports none
of them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.engine.compile import CompileFallback  # noqa: E402
from fastlm.engine.optim import build_optimizer  # noqa: E402
from fastlm.layers.embedding import document_positions  # noqa: E402
from fastlm.layers.packed_attention import attention_layout  # noqa: E402
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossTargets  # noqa: E402
from fastlm.models import build_model  # noqa: E402
from fastlm.models.decoder import DecoderLM  # noqa: E402
from fastlm.run_config.schema import RunConfig  # noqa: E402 - after the path fix
from fastlm.system.device import autocast  # noqa: E402

DOC_MIN, DOC_MAX = 150, 450  # packed documents: lengths uniform in [150, 450], ~300 tokens on average


VARIANT_PARTS = ("packed", "compile", "ac", "dense", "offload", "tiles")
TILE_LEN = 8192  # the tiles variant's trainer.mlp_tile_len


def parse_variant(variant: str) -> set[str]:
    """'plain', or '+'-joined parts: packed (~300-token documents), compile, ac, dense (force the dense mask),
    offload (ac's block inputs in host memory: trainer.activation_offload), tiles (trainer.mlp_tile_len TILE_LEN)."""
    parts = set() if variant == "plain" else set(variant.split("+"))
    unknown = parts - set(VARIANT_PARTS)
    if unknown:
        raise SystemExit(f"unknown variant part(s) {sorted(unknown)} in {variant!r}; use 'plain' or {VARIANT_PARTS}")
    return parts


def packed_document_ids(batch: int, seq_len: int, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    """(B, S) ids of contiguous documents with lengths uniform in [low, high], cut at the row end, unique per batch."""
    ids = torch.empty(batch, seq_len, dtype=torch.long)
    next_id = 0
    for row in range(batch):
        start = 0
        while start < seq_len:
            length = int(torch.randint(low, high + 1, (1,), generator=generator))
            ids[row, start : start + length] = next_id
            start, next_id = start + length, next_id + 1
    return ids


def model_config(preset: str, loss: str, vocab_override: int | None, logits_memory_mib: float | None = None,
                 z_loss: bool = True) -> RunConfig:
    data = yaml.safe_load((ROOT / "configs" / "presets" / f"{preset}.yaml").read_text())
    model = data["model"]
    losses = {"cross_entropy": {}, **({"z_loss": {"weight": 1e-4}} if z_loss else {})}
    model["head"] = {"use_triton": loss == "triton", "losses": losses, "logits_memory_mib": logits_memory_mib}
    if vocab_override:
        model["vocab_size"] = vocab_override
    return RunConfig.model_validate({"model": model})


def measured_peak_flops(device: torch.device) -> float:
    """bf16 matmul rate on this device (CUDA), or float32 on CPU; FLOP/s."""
    size = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    repeats = 20 if device.type == "cuda" else 3
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class StepBatch(NamedTuple):
    """One micro-batch as this loop feeds it, on the device: labels flat, documents (B, S) or None."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    documents: torch.Tensor | None
    tokens: float  # unmasked labels: the step's token normaliser


def synthetic_batches(vocab: int, batch: int, seq_len: int, packed: bool, device: torch.device,
                      count: int = 2) -> list[StepBatch]:
    """Random tokens; packed rows hold DOC_MIN-DOC_MAX-token documents, each one's last label masked (as packing does)."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        documents = None
        if packed:
            documents = packed_document_ids(batch, seq_len, DOC_MIN, DOC_MAX, generator)
            ends = torch.ones_like(documents, dtype=torch.bool)
            ends[:, :-1] = documents[:, 1:] != documents[:, :-1]
            labels[ends] = IGNORE_INDEX
        batches.append(StepBatch(tokens[:, :-1].to(device), labels.reshape(-1).to(device),
                                 None if documents is None else documents.to(device),
                                 float((labels != IGNORE_INDEX).sum())))
    return batches


def attention_span(batch: StepBatch, seq_len: int) -> float:
    """The keys a token's attention covers, token-weighted: seq_len for plain rows; sum(L^2) / sum(L) over
    the packed documents (each row's runs of one document id)."""
    if batch.documents is None:
        return float(seq_len)
    squares = 0
    for row in batch.documents.cpu():
        _, lengths = torch.unique_consecutive(row, return_counts=True)
        squares += int((lengths.long() ** 2).sum())
    return squares / batch.documents.numel()


class Loop:
    """What a step of this benchmark is, on one model: bf16 autocast forward with the fused loss, backward,
    fused AdamW (as the trainer builds it); no clipping, schedule or checks, and no read-back of its own
    (the LM head's value-check and grad_output reads only)."""

    def __init__(self, preset: str, loss: str, variant: str, device: torch.device, vocab_override: int | None = None,
                 logits_memory_mib: float | None = None, z_loss: bool = True) -> None:
        parts = parse_variant(variant)
        self.config = model_config(preset, loss, vocab_override, logits_memory_mib, z_loss)
        self.device = device
        self.packed = "packed" in parts
        torch.manual_seed(0)
        self.model = build_model(self.config.model, device=device)
        self.model.set_memory_savers("ac" in parts, "offload" in parts, TILE_LEN if "tiles" in parts else 0)
        if "dense" in parts:
            self.model.attention_kind = "dense"
        if "compile" in parts:
            self.model.compile_blocks()
        self.fallback = CompileFallback(self.model, verbose=False)
        self.optimizer = build_optimizer(self.model, self.config.optimizer)  # fused AdamW on CUDA, as in the trainer
        self.amp = torch.bfloat16 if device.type == "cuda" else None

    def step(self, batch: StepBatch) -> None:
        def forward_backward() -> None:
            documents = batch.documents
            targets = LossTargets(labels=batch.labels, document_ids=None if documents is None else documents.reshape(-1))
            with autocast(self.device, self.amp):
                result = self.model(batch.input_ids, targets, LossNormalizers(tokens=batch.tokens), documents)
            result.loss.backward()

        self.fallback.run(forward_backward, lambda: self.optimizer.zero_grad(set_to_none=True))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def attention(self, batch: StepBatch) -> str:
        """The layouts the model's forward builds for `batch` (one per distinct window): causal, flex or dense."""
        positions = None if batch.documents is None else document_positions(batch.documents)
        rows, seq_len = batch.input_ids.shape
        windows = {attention.window for attention in self.model.layer_attention}
        kinds = {self.model.attention_kind or attention_layout(rows, seq_len, positions, window, self.device,
                                                                       head_dim=self.model.config.head_dim).kind
                 for window in windows}
        return "+".join(sorted(kinds))

    def head(self) -> str:
        return f"chunked {self.model.head.logits_memory_mib:g} MiB" if self.model.head.chunked else "full logits"


class HFLoop:
    """The same step on transformers' own model class for the family, holding `model`'s weights: bf16
    autocast, fused AdamW, SDPA; Liger's fused linear cross-entropy when it imports (see the docstring)."""

    def __init__(self, model: DecoderLM, variant: str, device: torch.device) -> None:
        import transformers

        from fastlm.data.tokenizer import ByteTokenizer
        from fastlm.models.hf import config_to_hf, to_hf_state

        parts = parse_variant(variant)
        self.packed = "packed" in parts
        hf = config_to_hf(model.config, ByteTokenizer())
        config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k not in ("architectures", "dtype")},
                                                   use_cache=False)  # training: no KV cache built in the forward
        with torch.device(device):
            self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        missing, unexpected = self.model.load_state_dict(to_hf_state(model.state_dict(), model.config), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"weights do not map onto {type(self.model).__name__}: {missing} {unexpected}")
        self.model.tie_weights()
        self.model.train()
        if "ac" in parts:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if "compile" in parts:
            for layer in self.model.model.layers:
                layer.compile()
        self.liger = liger_loss()
        self.loss_name = "transformers+liger" if self.liger is not None else "transformers (HF loss)"
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **fused)
        self.device = device
        self.amp = torch.bfloat16 if device.type == "cuda" else None

    def step(self, batch: StepBatch) -> None:
        rows, seq_len = batch.input_ids.shape
        positions = None if batch.documents is None else document_positions(batch.documents)
        labels = batch.labels.view(rows, seq_len)
        with autocast(self.device, self.amp):
            if self.liger is None:
                loss = self.model(batch.input_ids, position_ids=positions, labels=labels, shift_labels=labels).loss
            else:
                hidden = self.model.model(batch.input_ids, position_ids=positions).last_hidden_state
                loss = self.liger(self.model.lm_head.weight, hidden.reshape(-1, hidden.shape[-1]), batch.labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def liger_loss() -> torch.nn.Module | None:
    """Liger's fused linear cross-entropy (mean over unmasked tokens), or None when liger_kernel is absent."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss()


def time_steps(loop: Loop | HFLoop, batches: list[StepBatch], steps: int, warmup: int,
               device: torch.device) -> tuple[float, float]:
    """Seconds per step after `warmup` steps, and the peak GiB allocated from the loop's first step on."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for index in range(warmup):
        loop.step(batches[index % len(batches)])
    _synchronize(device)
    start = time.perf_counter()
    for index in range(steps):
        loop.step(batches[index % len(batches)])
    _synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    return seconds, torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
