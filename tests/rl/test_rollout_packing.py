"""Packing prompt + completion samples: masks, alignment, unique ids, whole documents; old_logp vs float64."""

from __future__ import annotations

import pytest
import torch

from fastlm.data.offline_rl import PolicySample
from fastlm.data.tokenizer import BOS, EOS, PAD
from fastlm.losses.spec import IGNORE_INDEX
from fastlm.rl.packing import PolicyBatchLoader, pack_policy_samples, policy_logprobs, rows_to_batch, split_into_batches
from tests.rl.rl_helpers import reference_logprobs, rel_err, tiny_model


def _samples(count: int, seed: int = 0) -> list[PolicySample]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        prompt = [BOS] + torch.randint(
            40, 60, (int(torch.randint(2, 5, (1,), generator=generator)),), generator=generator
        ).tolist()
        completion = torch.randint(
            40, 60, (int(torch.randint(1, 4, (1,), generator=generator)),), generator=generator
        ).tolist() + [EOS]
        old = (-torch.rand(len(completion), generator=generator) - 0.01).tolist()
        out.append(PolicySample(prompt, completion, float(torch.randn(1, generator=generator)), old))
    return out


def test_packed_batch_layout() -> None:
    samples = _samples(12)
    rows = pack_policy_samples(samples, seq_len=15, pad_id=PAD)
    batch = rows_to_batch(rows, torch.arange(len(rows)))
    found = 0
    for row in range(batch.labels.shape[0]):
        for doc in batch.document_ids[row].unique().tolist():
            where = (batch.document_ids[row] == doc).nonzero().flatten()
            labelled = where[batch.labels[row, where] != IGNORE_INDEX]
            if labelled.numel() == 0:
                continue
            # labels of one document: a whole completion, prompt masked, floats aligned with the labels
            sample = next(s for s in samples if s.completion_tokens == batch.labels[row, labelled].tolist()
                          and s.old_logp == pytest.approx(batch.old_logp[row, labelled].tolist()))
            assert torch.all(batch.advantages[row, labelled] == torch.tensor(sample.advantage, dtype=torch.float32))
            assert batch.input_ids[row, where[0]] == BOS
            assert labelled.numel() == len(sample.completion_tokens)  # never split across rows
            found += 1
    assert found == len(samples)
    masked = batch.labels == IGNORE_INDEX
    assert torch.all(batch.old_logp[masked] == 0) and torch.all(batch.advantages[masked] == 0)
    # ids unique across the flattened batch: no id appears in two rows
    per_row = [set(r.tolist()) for r in batch.document_ids]
    assert all(not (a & b) for i, a in enumerate(per_row) for b in per_row[i + 1 :])
    assert batch.num_documents == len(samples)
    assert batch.padding.any() and torch.equal(batch.padding, batch.input_ids == PAD)  # the rows' tails, flagged


def test_split_and_loader() -> None:
    rows = pack_policy_samples(_samples(20), seq_len=15, pad_id=PAD)
    parts = split_into_batches(rows, 3)
    assert sum(b.labels.shape[0] for b in parts) == len(rows) and len(parts) == 3
    assert sum(b.num_documents for b in parts) == 20
    with pytest.raises(ValueError, match="rows cannot fill 11 micro-batches"):
        split_into_batches(rows, len(rows) + 1)
    loader = PolicyBatchLoader(rows, batch_size=2, seed=0)
    state = loader.state_dict()
    first = loader.next_batch()
    loader.load_state_dict(state)
    assert torch.equal(loader.next_batch().old_logp, first.old_logp)


def test_too_long_sample_is_named() -> None:
    sample = PolicySample([BOS] * 10, [EOS] * 10, 1.0)
    with pytest.raises(ValueError, match="sample 0 has 20 tokens .* data.seq_len \\+ 1 = 16"):
        pack_policy_samples([sample], seq_len=15, pad_id=PAD)


@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (0.8, 3.0)])
def test_policy_logprobs_match_float64_unpacked_forward(scale: float, softcap: float | None) -> None:
    model = tiny_model(1)
    samples = _samples(10, seed=2)
    rows = pack_policy_samples(samples, seq_len=20, pad_id=PAD)
    batch = rows_to_batch(rows, torch.arange(len(rows)))
    got = policy_logprobs(model, batch, scale, softcap)
    masked = batch.labels == IGNORE_INDEX
    assert torch.all(got[masked] == 0)
    worst, checked = 0.0, 0
    for sample in samples:
        sequence = sample.prompt_tokens + sample.completion_tokens
        want = reference_logprobs(model, sequence, len(sample.prompt_tokens), scale, softcap)
        for row in range(batch.labels.shape[0]):
            for doc in batch.document_ids[row].unique():
                where = (batch.document_ids[row] == doc) & ~masked[row]
                if batch.labels[row, where].tolist() == sample.completion_tokens and \
                        batch.input_ids[row, batch.document_ids[row] == doc].tolist()[: len(sequence) - 1] == sequence[:-1]:
                    worst = max(worst, rel_err(got[row, where], want))
                    checked += 1
    print(f"packed old_logp (scale {scale}, softcap {softcap}) vs float64 unpacked forward: max rel err {worst:.2e}")
    assert checked == len(samples)
    assert worst < 1e-4


def test_short_completions_still_fill_every_micro_batch() -> None:
    """Eight short samples fit in one row of 64; asked for 8 micro-batches, packing spreads them (whole documents,
    same tokens and advantages), and the step's batches hold every completion token once."""
    samples = _samples(8, seed=3)
    assert len(pack_policy_samples(samples, seq_len=63, pad_id=PAD)) == 1
    rows = pack_policy_samples(samples, seq_len=63, pad_id=PAD, min_rows=8)
    assert len(rows) == 8
    batches = split_into_batches(rows, 8)
    labelled = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
    assert labelled == sum(len(s.completion_tokens) for s in samples)
    advantages = sorted(float(b.advantages[b.labels != IGNORE_INDEX].sum()) for b in batches)
    expected = sorted(s.advantage * len(s.completion_tokens) for s in samples)
    assert advantages == pytest.approx(expected)
    assert len(pack_policy_samples(samples, seq_len=63, pad_id=PAD, min_rows=20)) == 8  # at most one row per sample


def test_policy_logprobs_over_chunks_equal_one_chunk() -> None:
    """A budget of a few rows of logits runs the head over many chunks (never the whole batch's logits),
    with the same log-probs as one chunk."""
    model = tiny_model(1)
    rows = pack_policy_samples(_samples(10, seed=3), seq_len=20, pad_id=PAD)
    batch = rows_to_batch(rows, torch.arange(len(rows)))
    whole = policy_logprobs(model, batch, 0.8, 3.0, budget_mib=0)
    chunks: list[int] = []
    head_logits = model.head_logits
    model.head_logits = lambda hidden, weight=None: chunks.append(hidden.shape[0]) or head_logits(hidden, weight)
    row_bytes = model.config.vocab_size * (4 + 8)
    got = policy_logprobs(model, batch, 0.8, 3.0, budget_mib=5 * row_bytes / 2**20)  # 5 rows of logits
    print(f"{batch.labels.numel()} tokens in {len(chunks)} chunks of at most {max(chunks)}: "
          f"max |diff| {float((got - whole).abs().max()):.1e}")
    assert len(chunks) > 1 and max(chunks) <= 5 and sum(chunks) == batch.labels.numel()
    assert torch.allclose(got, whole, rtol=0, atol=1e-6) and torch.all(got[batch.labels == IGNORE_INDEX] == 0)
