"""Activation offload: the checkpointed blocks' inputs wait for the backward in pinned CPU memory.

With activation checkpointing each block keeps only its input, (tokens, hidden) per layer: at 128k tokens
and 28 layers of 2048 that is 14 GiB in bf16, the largest thing left on the GPU. Offloaded, each input is
copied to pinned host memory on a side stream as the forward passes it (its GPU memory is released once
that copy is done), and copied back on the same side stream one block ahead of the backward: when the
backward recomputes block i, block i-1's input is already on its way (Unsloth's offloaded checkpoints and
ALST keep activations the same way).
"""

from __future__ import annotations

import torch


class OffloadedInput:
    """One block input: on the GPU until its forward used it, in host memory until its recomputation."""

    def __init__(self, offload: ActivationOffload, x: torch.Tensor, previous: OffloadedInput | None) -> None:
        self.offload, self.previous = offload, previous
        self.gpu: torch.Tensor | None = x
        self.requires_grad = x.requires_grad
        self.device = x.device
        self.loaded: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        stream = offload.stream
        if stream is None:  # CPU: a copy stands for the host buffer
            self.host = x.detach().clone()
            return
        self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            self.host.copy_(x.detach(), non_blocking=True)
        x.record_stream(stream)  # the allocator reuses x's memory only after the copy

    def take(self) -> torch.Tensor:
        """The input: the live tensor in the forward, the copy brought back in the recomputation (which
        starts bringing back the block before this one)."""
        if self.gpu is not None:
            x, self.gpu = self.gpu, None
            return x
        self.prefetch()
        x, self.loaded = self.loaded, None
        assert x is not None
        if self.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.ready)
            x.record_stream(current)
        if self.previous is not None:
            self.previous.prefetch()
        return x.requires_grad_(self.requires_grad)

    def prefetch(self) -> None:
        """Start copying the input back (once)."""
        if self.loaded is not None or self.host is None:
            return
        stream = self.offload.stream
        if stream is None:
            self.loaded, self.host = self.host, None
            return
        with torch.cuda.stream(stream):
            self.loaded = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)
        self.host = None


class ActivationOffload:
    """The side stream and the chain of a forward's offloaded block inputs (`start` begins a new forward)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last: OffloadedInput | None = None

    def start(self) -> None:
        self.last = None

    def store(self, x: torch.Tensor) -> OffloadedInput:
        self.last = OffloadedInput(self, x, self.last)
        return self.last
