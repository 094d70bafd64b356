"""Rollouts one policy version ahead (`rl.max_policy_lag` >= 1): the next rollout is sampled on a worker thread
from a snapshot of the weights while the current one trains.

The sampler is a frozen replica of the policy (`sync` copies the trainer's weights into it and names their
version: the number of optimizer steps they have). Every hand-over happens on the trainer's thread at a rollout
due point, so the run is deterministic: the served rollout was sampled at the previous due point, then the
replica takes the current weights and the next rollout starts sampling while this one trains. On CUDA the worker
samples on its own stream, ordered after the weight copy; the trainer's stream waits for it before it reads the
rollout. A checkpoint holds the sampled-ahead rollout (`RolloutStream.state_dict` waits for it), so a resumed run
trains on the rollouts it would have used.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from fastlm.models.decoder import DecoderLM
from fastlm.rl.rollout import Rollout


def sampler_replica(model: DecoderLM) -> DecoderLM:
    """A frozen copy of the policy for the sampler (eval mode, no gradients), on the policy's device."""
    replica = copy.deepcopy(model)
    replica.requires_grad_(False)
    return replica.eval()


class RolloutPrefetch:
    """One rollout sampled ahead on a worker thread, from the replica's weights (see the module docstring)."""

    def __init__(self, replica: DecoderLM):
        self.replica = replica
        self.version = 0  # the optimizer steps of the weights the replica holds
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastlm-rollout")
        cuda = replica.output_weight.device.type == "cuda"
        self.stream = torch.cuda.Stream(replica.output_weight.device) if cuda else None

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, version: int) -> None:
        """The replica takes the trainer's current weights (an in-place copy: the sampler's graphs stay valid)."""
        live = dict(model.state_dict(keep_vars=False))
        for name, value in self.replica.state_dict(keep_vars=False).items():
            value.copy_(live[name])
        self.version = version

    def submit(self, collect: Callable[[DecoderLM], Rollout]) -> Future[Rollout]:
        """Start `collect(replica)` on the worker: on CUDA on the sampler's stream, after the weight copy."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

        def run() -> Rollout:
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                return collect(self.replica)

        return self.executor.submit(run)

    def wait(self, future: Future[Rollout]) -> Rollout:
        """The sampled rollout (its error, if sampling failed), ordered before the trainer's next kernels."""
        rollout = future.result()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return rollout

    def close(self) -> None:
        self.executor.shutdown(wait=True)
