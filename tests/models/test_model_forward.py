"""`DecoderLM.forward` wires hidden states into the LM head: loss and every parameter gradient equal a
float64 cross-entropy + z-loss computed by hand on `logits()`."""

from __future__ import annotations

import pytest
import torch
from model_helpers import make_model, relative_error, small_gpt2, small_llama

from fastlm.losses.children import CrossEntropyConfig, ZLossConfig
from fastlm.losses.config import LMHeadConfig
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossTargets

Z_WEIGHT = 0.01


def _head() -> LMHeadConfig:
    return LMHeadConfig(
        losses={"ce": CrossEntropyConfig(), "z": ZLossConfig(weight=Z_WEIGHT)}, use_triton=False
    )


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_forward_matches_float64_reference(kind: str) -> None:
    config = small_gpt2(head=_head()) if kind == "gpt2" else small_llama(head=_head(), sliding_window=6)
    model = make_model(config)
    torch.manual_seed(5)
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    document_ids = torch.tensor([[0] * 5 + [1] * 7, [3] * 12])
    labels = torch.randint(0, config.vocab_size, (2, 12))
    labels[0, 4] = labels[1, -1] = labels[1, 2] = IGNORE_INDEX
    flat = labels.flatten()
    normalizer = float((flat != IGNORE_INDEX).sum()) + 3.0  # as if other micro-batches held 3 more tokens

    result = model(tokens, LossTargets(labels=flat), LossNormalizers(tokens=normalizer), document_ids)
    grads = torch.autograd.grad(result.loss, list(model.parameters()))

    logits = model.logits(tokens, document_ids).flatten(0, 1)
    keep = flat != IGNORE_INDEX
    lse = logits.logsumexp(-1)[keep]
    label_logit = logits[keep].gather(1, flat[keep, None]).squeeze(1)
    reference = ((lse - label_logit).sum() + Z_WEIGHT * (lse**2).sum()) / normalizer
    ref_grads = torch.autograd.grad(reference, list(model.parameters()))

    loss_error = relative_error(result.loss, reference)
    grad_error = max(relative_error(g, r) for g, r in zip(grads, ref_grads))
    print(f"{kind} forward vs float64 reference: loss rel err {loss_error:.2e}, worst grad rel err {grad_error:.2e}")
    assert loss_error < 1e-10 and grad_error < 1e-10
    assert set(result.losses) == {"ce", "z"}
