"""The one choice of backend for loss_type grpo's per-token weight w_t = scale / |i| (token t of document i).

Where the labels are on CUDA and triton imports, one block-parallel Triton launch (triton/documents.py:
no sort, no device->host sync, float32, the same values bit for bit as the torch form); elsewhere None,
and the child computes its torch form (`PolicyChild.token_weights`). The children ask for the weights
and pick no backend.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def launched_document_means(document_ids: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor | None:
    """float32 scale / |i| on every unmasked token (0 on masked ones) by one Triton launch on CUDA tensors, else None."""
    if not (labels.is_cuda and _triton_importable()):
        return None
    from fastlm.losses.triton.documents import document_mean_weights

    return document_mean_weights(document_ids, labels, scale)
