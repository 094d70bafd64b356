"""The fused kernel's per-token term buffer and its end-of-call value checks.

The fused launch writes every loss/metric term into a (K, T) buffer and counts the bad values
itself; `triton_loss` reduces the buffer with one sum and raises on the counts only at the end.
Checked here: the terms against the torch tail in fp32, the row layout, the kernel's counts against
`validation.value_flags`, and that
out-of-range labels and NaN policy inputs end in the named error, never a crash or a NaN result
(each loss, metric and gradient against float64 is test_matrix.py).
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from loss_cases import make_case, make_spec, rel_err, seed_of

from fastlm.losses.compiled import compiled_loss
from fastlm.losses.spec import LossNormalizers, LossTargets
from fastlm.losses.triton.interface import interface
from fastlm.losses.triton.launcher import fused_kernel_only, triton_loss
from fastlm.losses.validation import value_flags

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOL = 1e-5
SPECS = {  # (kinds, numbers): every term group, with logit scaling and softcap
    "ce+z+grpo+kd": ("ce+z+grpo+kd", {"logit_scale": 1.3, "softcap": 4.0}),
    "grpo+z w0": ("grpo+z", {"logit_scale": 0.7}),
    "ce+kd_rev": ("ce+kd_rev", {}),
    "gspo+z": ("gspo+z", {"softcap": 3.0}),  # the per-document child's rows from its seam
    "ce+gspo_len w0": ("ce+gspo_len", {}),
}


def _to_device(targets: LossTargets, device: torch.device = DEVICE) -> LossTargets:
    return LossTargets(*(None if t is None else t.to(device) for t in dataclasses.astuple(targets)))


def _case(name: str, tokens: int = 24):
    kinds, numbers = SPECS[name]
    weights = {"grpo": 0.0, "gspo_len": 0.0} if "w0" in name else None
    spec = make_spec(kinds, weights, **numbers)
    logits, targets, normalizers = make_case(seed_of("fused" + name), tokens=tokens, vocab=37, spec=spec)
    return spec, logits.to(DEVICE), _to_device(targets), normalizers


@pytest.mark.parametrize("name", list(SPECS))
def test_terms_match_the_torch_tail_in_fp32(name: str) -> None:
    """Same keys and values (fp32) as the torch tail the other paths keep (compiled, fp32)."""
    spec, logits, targets, normalizers = _case(name)
    result, _ = triton_loss(logits, targets, normalizers, spec, max_block=16)
    torch_tail, _ = compiled_loss(logits, targets, normalizers, spec)
    assert list(result.losses) == list(torch_tail.losses) and list(result.metrics) == list(torch_tail.metrics)
    errors = {key: rel_err(value, torch_tail.metrics[key]) for key, value in result.metrics.items()}
    errors.update({key: rel_err(value, torch_tail.losses[key]) for key, value in result.losses.items()})
    print(f"{name} fused vs torch tail (fp32): " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < 2e-6, errors


def test_layout_rows() -> None:
    """Each child's rows from its start in child order, the total after them, then the counts; a
    per-document child (GSPO) has its token metrics (the fused launch's), then its loss and document
    metrics (its seam's), and the per-token state after the counts, outside the summed rows."""
    layout = interface(make_spec("ce+z+grpo+kd")).layout
    assert layout.starts == {"ce": 0, "z": 1, "grpo": 3, "kd": 12}
    assert (layout.total, layout.flags, layout.rows) == (13, 14, 18)
    assert layout.keys[2] == (False, "z/lse") and layout.keys[3 + 3] == (False, "grpo/kl_old")
    assert (layout.state, layout.summed) == (-1, 18)
    assert interface(make_spec("ce")).layout.rows == 4  # ce, total, 2 counts
    gspo = interface(make_spec("gspo+z+kd")).layout
    assert gspo.starts == {"gspo": 0, "z": 10, "kd": 12}
    assert gspo.keys[:3] == tuple((False, f"gspo/{name}") for name in ("new_logp", "entropy", "kl_old"))
    assert gspo.keys[3:5] == ((True, "gspo"), (False, "gspo/ratio")) and gspo.keys[9] == (False, "gspo/num_documents")
    assert (gspo.total, gspo.flags, gspo.summed, gspo.state, gspo.rows) == (13, 14, 18, 18, 25)
    with_reference = interface(make_spec("grpo", options={"grpo": {"beta": 0.1}})).layout
    assert with_reference.keys[4] == (False, "grpo/kl") and with_reference.total == 10


def _spoil(targets: LossTargets) -> LossTargets:
    """Two labels out of range (one far past any allocation), one NaN old_logp, one inf advantage."""
    unmasked = (targets.labels != -100).nonzero()[:, 0].tolist()
    labels, old_logp, advantages = targets.labels.clone(), targets.old_logp.clone(), targets.advantages.clone()
    labels[unmasked[0]], labels[unmasked[1]] = 10**12, -7
    old_logp[unmasked[2]] = float("nan")
    advantages[unmasked[3]] = float("inf")
    return dataclasses.replace(targets, labels=labels, old_logp=old_logp, advantages=advantages)


# inf/NaN policy inputs make inf - inf in the interpreter's numpy: expected, the results are discarded.
BAD_INPUT_WARNING = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@BAD_INPUT_WARNING
def test_kernel_counts_equal_value_flags() -> None:
    """The counts rows the fused kernel writes = value_flags' torch counts, on good and bad inputs."""
    spec, logits, targets, normalizers = _case("ce+z+grpo+kd")
    layout = interface(spec).layout
    for case in (targets, _spoil(targets)):
        grad = torch.empty_like(logits)
        terms = fused_kernel_only(logits, case, normalizers, spec, grad, max_block=16)
        _, expected = value_flags(logits, case, spec)
        counts = terms[layout.flags :].sum(dim=1)
        print(f"kernel counts {counts.tolist()} vs value_flags {expected.tolist()}")
        assert counts.tolist() == expected.float().tolist()
    assert expected.tolist() == [2, int((targets.labels != -100).sum()), 1, 1]


@BAD_INPUT_WARNING
@pytest.mark.parametrize("path", ["fused", "fused in-place", "gspo", "compiled"])
def test_bad_values_raise_named_errors_at_the_end(path: str) -> None:
    """Labels far out of range read no memory (masked load) and NaN/inf policy inputs only feed
    discarded results: each call ends in the named error, in the order labels, old_logp, advantages."""
    name = "gspo+z" if path == "gspo" else "ce+z+grpo+kd"
    spec = make_spec(name)
    logits, targets, normalizers = make_case(seed_of("bad" + path), vocab=37, spec=spec)
    logits, targets = logits.to(DEVICE), _to_device(targets)

    def call(case: LossTargets) -> None:
        if path == "compiled":
            compiled_loss(logits, case, normalizers, spec)
        else:
            triton_loss(logits.clone(), case, normalizers, spec, max_block=16, inplace=path.endswith("in-place"))

    spoiled = _spoil(targets)
    with pytest.raises(ValueError, match=r"targets.labels\[\d+\] = 1000000000000 is outside the vocabulary \[0, 37\)"):
        call(spoiled)
    unmasked = (targets.labels != -100).nonzero()[:, 0].tolist()
    spoiled.labels[unmasked[0]] = 3
    with pytest.raises(ValueError, match=rf"targets.labels\[{unmasked[1]}\] = -7 is outside"):
        call(spoiled)
    spoiled.labels[unmasked[1]] = 3
    with pytest.raises(ValueError, match=rf"targets.old_logp has a non-finite value \(nan\) at unmasked token {unmasked[2]}"):
        call(spoiled)
    spoiled.old_logp[unmasked[2]] = -1.0
    with pytest.raises(ValueError, match=rf"targets.advantages has a non-finite value \(inf\) at unmasked token {unmasked[3]}"):
        call(spoiled)
    spoiled.advantages[unmasked[3]] = 0.5
    call(spoiled)  # repaired: no error


def test_unmasked_tokens_need_a_token_count() -> None:
    """The zero-normaliser error comes from the kernel's unmasked count; all-masked with 0 is fine."""
    spec, logits, targets, _ = _case("grpo+z w0")
    with pytest.raises(ValueError, match="normalizers.tokens must be > 0"):
        triton_loss(logits, targets, LossNormalizers(0.0, 0.0), spec)
    masked = dataclasses.replace(targets, labels=torch.full_like(targets.labels, -100))
    result, grad = triton_loss(logits, masked, LossNormalizers(0.0, 0.0), spec, max_block=16)
    assert float(result.loss) == 0.0 and all(float(v) == 0.0 for v in (*result.losses.values(), *result.metrics.values()))
    assert torch.count_nonzero(grad) == 0
