"""torch.distributed for the trainer: launch under torchrun, the (dp, tp) mesh, data-parallel wrapping,
rank-sharded data, reductions over ranks, gradient clipping and gathered (full) checkpoint state.

Layout: a DeviceMesh of shape (dp, tp) named ("dp", "tp"), world = dp * tp. The tp ranks of one dp
group see the same data and hold one vocab shard each of the embedding / output weight
(fastlm/layers/vocab_parallel.py); everything else is replicated over tp. Data parallelism is DDP
over the dp group or FSDP2 `fully_shard` over the dp mesh (FSDP needs tensor_parallel 1).

Loss averaging: the step normalizers are summed over dp, so each rank's loss is its share of the
global mean and the global gradient is the *sum* of the ranks' gradients; DDP and FSDP average over
dp, so the trainer scales each backward by dp (exact for a power-of-two dp).

Checkpoints hold the full (gathered) state in the single-process layout, so they resume at any
world size and tensor-parallel size.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fastlm.data.batch import Batch
from fastlm.engine.config import DistributedConfig
from fastlm.layers.vocab_parallel import gather_vocab, make_vocab_parallel, sharded_parameter_names
from fastlm.losses.spec import ProcessGroup

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun_env() -> bool:
    """True when started by torchrun (or anything that sets RANK, WORLD_SIZE and LOCAL_RANK)."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto`: nccl on CUDA, gloo on CPU; nccl without CUDA is a named error."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("distributed.backend is 'nccl' but the run is on CPU; use 'gloo' or 'auto'")
    return backend


def run_distributed(main: Callable[[], int], config: DistributedConfig, device: torch.device) -> int:
    """Init the process group from the torchrun environment, run `main`, destroy the group.

    A rank that raises prints its traceback to stderr, every line prefixed `[rank N]`, and returns 1;
    torchrun then stops the other ranks. Those never hang forever: every collective times out after
    `distributed.timeout_minutes`. The group is not destroyed after a failure (that could wait on peers).
    """
    rank = int(os.environ["RANK"])
    try:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(
            resolve_backend(config.backend, device), timeout=timedelta(minutes=config.timeout_minutes)
        )
        status = main()
    except BaseException:  # noqa: BLE001 - any failure of this rank must end the job, with its traceback
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in traceback.format_exc().splitlines()))
        sys.stderr.flush()
        return 1
    dist.destroy_process_group()
    return status


@dataclass(frozen=True)
class Parallel:
    """Where this process sits: world rank, data-parallel and tensor-parallel coordinates and groups."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    mesh: DeviceMesh | None = None
    data_parallel: str = "ddp"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self.mesh.get_group("dp") if self.mesh is not None and self.dp_size > 1 else None

    @property
    def tp_group(self) -> ProcessGroup | None:
        return self.mesh.get_group("tp") if self.mesh is not None and self.tp_size > 1 else None


def build_parallel(config: DistributedConfig, device: torch.device) -> Parallel:
    """The (dp, tp) mesh over the initialized process group; a plain single process when there is none."""
    tp = config.tensor_parallel
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % tp:
        raise ValueError(
            f"distributed.tensor_parallel {tp} does not divide the world size {world}; "
            f"launch with torchrun --nproc-per-node a multiple of {tp}"
        )
    if config.data_parallel == "fsdp" and tp > 1:
        raise ValueError("distributed.data_parallel 'fsdp' with tensor_parallel > 1 is not supported; use 'ddp'")
    if world == 1:
        return Parallel(data_parallel=config.data_parallel)
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return Parallel(
        rank=dist.get_rank(),
        world_size=world,
        dp_rank=mesh.get_local_rank("dp"),
        dp_size=world // tp,
        tp_rank=mesh.get_local_rank("tp"),
        tp_size=tp,
        mesh=mesh,
        data_parallel=config.data_parallel,
    )


def local_device(device: torch.device) -> torch.device:
    """A CUDA device with its index (the one torchrun's LOCAL_RANK selected), as DDP needs."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device


def parallelize(model: nn.Module, parallel: Parallel, device: torch.device) -> nn.Module:
    """Shard the vocab over tp (in place), then wrap for data parallelism; returns the module to train with.

    FSDP shards `model` in place (each block, then the root), so the returned module is `model`;
    DDP returns the wrapper and `model` stays the plain module (for eval, state dicts, attribute access).
    """
    if parallel.tp_group is not None:
        make_vocab_parallel(model, parallel.tp_group)
    if parallel.dp_size == 1:
        return model
    if parallel.data_parallel == "fsdp":
        dp_mesh = parallel.mesh["dp"]
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=parallel.dp_group)


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce gradients over dp only on the step's last micro-batch (accumulate locally before it)."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(module, DistributedDataParallel) and not enabled:
        with module.no_sync():
            yield
    else:
        yield


def sum_over(values: dict[str, torch.Tensor], group: ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Additive scalars summed over `group` in one all-reduce (every rank must pass the same names)."""
    if group is None or not values:
        return values
    names = sorted(values)
    packed = torch.stack([values[name].detach().double().reshape(()) for name in names])
    dist.all_reduce(packed, group=group)
    return dict(zip(names, packed.unbind()))


def shard_batch(batch: Batch, index: int, count: int) -> Batch:
    """Rows index, index + count, ... of every tensor of the batch (a subclass keeps its extra fields)."""
    rows = {item.name: getattr(batch, item.name)[index::count] for item in fields(batch) if getattr(batch, item.name) is not None}
    return replace(batch, **rows)


class RankShardLoader:
    """This dp rank's rows of a loader built with micro_batch_size * dp: together the ranks see exactly
    the single-process batch of that size. The state is the wrapped loader's (the same on every rank)."""

    def __init__(self, loader: Any, index: int, count: int) -> None:
        self.loader = loader
        self.index = index
        self.count = count

    def next_batch(self) -> Batch:
        return shard_batch(self.loader.next_batch(), self.index, self.count)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def clip_grad_norm(model: nn.Module, max_norm: float | None, parallel: Parallel) -> torch.Tensor:
    """The global gradient norm as a device tensor (never read here: no host sync), the gradients
    clipped to `max_norm` first unless it is None; vocab-sharded gradients add their squared norms over tp."""
    group = parallel.tp_group
    if group is None:
        parameters = [p for p in model.parameters() if p.grad is not None]
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        else:
            norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    sharded = set(sharded_parameter_names(model))
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    zero = torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    squares = [
        sum((g.float().square().sum() for n, g in grads.items() if (n in sharded) == part), zero) for part in (False, True)
    ]
    dist.all_reduce(squares[1], group=group)
    norm = (squares[0] + squares[1]).sqrt()
    if max_norm is not None:
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads.values():
            grad.mul_(coefficient.to(grad.dtype))
    return norm


# --- full (gathered) checkpoint state, in the single-process layout ---------------------------------------
def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order: index i of `optimizer.state_dict()` is names[i]."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _vocab_rows(parallel: Parallel, rows: int) -> slice:
    return slice(parallel.tp_rank * rows, (parallel.tp_rank + 1) * rows)


def _sharded_indices(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """Optimizer index -> parameter, for the vocab-sharded parameters."""
    sharded = sharded_parameter_names(model)
    parameters = dict(model.named_parameters())
    return {i: parameters[name] for i, name in enumerate(_optimizer_names(model, optimizer)) if name in sharded}


def _map_tensors(
    state: dict[str, Any], parameter: torch.Tensor, function: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, Any]:
    """Apply `function` to the per-row state tensors (exp_avg, ...) of one parameter; scalars stay."""
    return {
        key: function(value) if isinstance(value, torch.Tensor) and value.shape == parameter.shape else value
        for key, value in state.items()
    }


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state, optimizer state) of the whole model on CPU, complete on rank 0; collective on every rank."""
    if isinstance(model, FSDPModule):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
        return model_state, (_index_keyed(optimizer_state) if optimizer_state else {})
    model_state = {name: value.detach().cpu() for name, value in model.state_dict().items()}
    optimizer_state = optimizer.state_dict()
    group = parallel.tp_group
    if group is None:
        return model_state, optimizer_state
    parameters = dict(model.named_parameters())
    for name in sharded_parameter_names(model):
        model_state[name] = gather_vocab(parameters[name].detach().t(), group).t().contiguous().cpu()
    states = dict(optimizer_state["state"])
    for index, parameter in _sharded_indices(model, optimizer).items():
        if index in states:
            states[index] = _map_tensors(
                states[index], parameter, lambda t: gather_vocab(t.t(), group).t().contiguous().cpu()
            )
    return model_state, {**optimizer_state, "state": states}


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    parallel: Parallel,
    strict: bool = True,
) -> None:
    """Load a full checkpoint state (any world size wrote it) into this rank's shards (`strict=False`: an
    adapter-only state, the frozen base as built)."""
    if isinstance(model, FSDPModule):
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(
            model, optimizer, _name_keyed(optimizer_state, _optimizer_names(model, optimizer)), options=options
        )
        return
    parameters = dict(model.named_parameters())
    sharded = sharded_parameter_names(model)
    model_state = {
        name: value[_vocab_rows(parallel, parameters[name].shape[0])] if name in sharded else value
        for name, value in model_state.items()
    }
    model.load_state_dict(model_state, strict=strict)
    states = dict(optimizer_state["state"])
    for index, parameter in _sharded_indices(model, optimizer).items():
        if index in states:
            rows = _vocab_rows(parallel, parameter.shape[0])
            full_shape = (parameter.shape[0] * parallel.tp_size, *parameter.shape[1:])
            states[index] = {
                key: value[rows] if isinstance(value, torch.Tensor) and tuple(value.shape) == full_shape else value
                for key, value in states[index].items()
            }
    optimizer.load_state_dict({**optimizer_state, "state": states})


def _index_keyed(state: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed's name-keyed optimizer state -> the `optimizer.state_dict()` layout (indices)."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]],
    }


def _name_keyed(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of `_index_keyed`, with this optimizer's parameter names."""
    return {
        "state": {names[int(index)]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]} for group in state["param_groups"]],
    }
