"""The block-parallel Triton document passes (`triton/documents.py`): loss_type grpo's per-token
weights equal the torch form (`PolicyChild.token_weights` on CPU) bit for bit, GSPO's seam gives the
same rows and coefficients in small programs as in one, and documents are runs of equal ids (an id
seen again after another document is a new document).

Without CUDA the kernel runs on Triton's interpreter (tests/conftest.py); small `max_block` values
make many programs, with runs crossing one or several block edges (the outward walks).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses

import pytest
from loss_cases import make_case, make_spec, rel_err, seed_of

from fastlm.losses.children.policy import document_slots, reference_documents
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossTargets
from fastlm.losses.triton.documents import document_mean_weights, gspo_seam
from fastlm.losses.triton.interface import interface
from fastlm.losses.triton.launcher import triton_stats

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _targets(seed: int, tokens: int, masked: float, longest: int = 40) -> LossTargets:
    """Runs of 1..`longest` tokens with unsorted ids, one id reused two runs later, ~`masked` labels at
    -100 and one run fully masked."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (tokens,), generator=generator)
    pool = torch.randperm(4 * tokens + 8, generator=generator) + 3
    runs = torch.repeat_interleave(torch.arange(tokens), lengths)[:tokens]
    ids = pool[runs]
    ids[runs == 3] = pool[1]  # run 3 reuses run 1's id (run 2 lies between)
    labels = torch.randint(0, 50, (tokens,), generator=generator)
    labels[torch.rand(tokens, generator=generator) < masked] = IGNORE_INDEX
    labels[runs == 2] = IGNORE_INDEX
    return LossTargets(labels, document_ids=ids)


@pytest.mark.parametrize("tokens,max_block,longest", [
    (1, 16, 40), (37, 16, 40), (256, 16, 40), (300, 64, 40), (1000, 4096, 40), (300, 16, 120), (200, 16, 400),
], ids=["one token", "3 blocks", "16 full blocks", "5 blocks", "1 block", "runs over 7 blocks", "one run"])
@pytest.mark.parametrize("masked", [0.0, 0.3, 1.0])
def test_kernel_equals_torch_bit_for_bit(tokens: int, max_block: int, longest: int, masked: float) -> None:
    """Every token's weight, masked ones 0; runs shorter than a block, crossing one edge, several edges
    ("runs over 7 blocks": up to 120 tokens in blocks of 16), and one run over the whole call."""
    targets = _targets(tokens + int(10 * masked), tokens, masked, longest)
    mask = targets.labels != IGNORE_INDEX
    documents = len(reference_documents(targets.document_ids, mask))
    normalizers = LossNormalizers(float(mask.sum()), float(documents) + 2.5)  # a step-wide count, not this call's
    child = make_spec("grpo", options={"grpo": {"loss_type": "grpo"}}).children[0]
    expected = child.token_weights(targets, normalizers)  # CPU: the torch form
    found = document_mean_weights(targets.document_ids.to(DEVICE), targets.labels.to(DEVICE),
                                  1.0 / normalizers.documents, max_block=max_block).cpu()
    print(f"T={tokens} block={max_block} masked={masked}: {documents} documents, "
          f"max |diff| {float((found - expected).abs().max()) if tokens else 0.0:.1e}")
    assert torch.equal(found, expected)
    assert torch.count_nonzero(found[~mask]) == 0


def test_documents_are_runs_of_equal_ids() -> None:
    """Counts per run, masked tokens inside a document do not split it, a reused id is a new document."""
    ids = torch.tensor([7, 7, 7, 3, 3, 7, 7, 9])
    labels = torch.tensor([1, IGNORE_INDEX, 1, 1, IGNORE_INDEX, 1, 1, IGNORE_INDEX])
    mask = labels != IGNORE_INDEX
    assert document_slots(ids, mask).tolist() == [1, 0, 1, 2, 0, 3, 3, 0]
    weights = document_mean_weights(ids.to(DEVICE), labels.to(DEVICE), 0.25, max_block=16).cpu()
    assert weights.tolist() == [0.125, 0.0, 0.125, 0.25, 0.0, 0.125, 0.125, 0.0]
    assert [tokens.nonzero()[:, 0].tolist() for tokens in reference_documents(ids, mask)] == [[0, 2], [3], [5, 6]]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])  # w_t: from the count, a scalar, a vector
def test_gspo_seam_in_small_blocks_equals_one_block(loss_type: str) -> None:
    """GSPO's seam launch in programs of 16 tokens (documents of up to 60 tokens cross several block
    edges) writes the rows and coefficients of one 512-token program: counts exactly, float sums to
    rounding (their order differs)."""
    spec = make_spec("gspo", options={"gspo": {"loss_type": loss_type, "beta": 0.1, "entropy_coeff": 0.05,
                                               "entropy_token_mean": False}})  # w_t-weighted entropy: the seam's
    logits, targets, _ = make_case(seed_of("seam blocks" + loss_type), tokens=300, vocab=37, spec=spec)
    targets = dataclasses.replace(targets, document_ids=_targets(3, 300, 0.0, longest=60).document_ids)
    mask = targets.labels != IGNORE_INDEX
    documents = len(reference_documents(targets.document_ids, mask))
    normalizers = LossNormalizers(float(mask.sum()), float(documents))
    logits, targets = logits.to(DEVICE), LossTargets(*(None if t is None else t.to(DEVICE)
                                                       for t in dataclasses.astuple(targets)))
    layout, child = interface(spec).layout, spec.children[0]
    terms = triton_stats(logits, targets, normalizers, spec)["terms"]
    found = {}
    for block in (16, 512):
        found[block] = terms.clone()
        gspo_seam(child, found[block], layout, targets, normalizers, max_block=block)
    first = layout.starts["gspo"] + len(child.token_metric_names())
    rows = {key: first + index for index, (_, key) in enumerate(layout.keys[first:layout.total])}
    rows.update({name: layout.state + layout.state_names.index(name) for name in ("prob_coeff", "label_coeff", "x_coeff")})
    errors = {key: rel_err(found[16][row].sum().cpu(), found[512][row].sum().cpu()) for key, row in rows.items()}
    errors.update({f"{key} per token": rel_err(found[16][row].cpu(), found[512][row].cpu()) for key, row in rows.items()
                   if key.endswith("coeff")})
    print(f"{loss_type}: {documents} documents, " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < 1e-6, errors
    assert float(found[16][rows["gspo/num_documents"]].sum()) == documents
