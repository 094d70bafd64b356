"""Shared pieces of the distributed tests: tiny run configs, gloo ranks spawned in-process, torchrun subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from fastlm.engine.checkpoint import MODEL_FILE, load_latest_checkpoint
from fastlm.run_config.schema import RunConfig

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def run_config(directory: Path, name: str, **sections: dict[str, Any]) -> dict[str, Any]:
    """A tiny llama run (1 layer, hidden 32, seq 16) as a plain dict (picklable for spawned ranks)."""
    base = {
        "run": {"name": name, "output_dir": f"{directory}/{{name}}", "seed": 0},
        "model": {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 16},
        "data": {"source": {"type": "generated", "num_documents": 60}, "seq_len": 16, "micro_batch_size": 2},
        "optimizer": {"lr": 1e-2},
        "schedule": {"warmup_steps": 0, "decay": "constant"},
        "trainer": {"steps": 3, "log_every": 1, "eval_every": 0, "checkpoint_every": 0, "eval_batches": 1, "device": "cpu"},
        "logging": {"wandb": {"enabled": False}, "progress": False},
    }
    return _merge(base, sections)


def spawn_ranks(worker: Callable[..., None], *args: Any, world: int = 2) -> None:
    """Run `worker(rank, world, *args)` on `world` spawned gloo ranks (a free local port) and wait for all of them.
    `worker` must be module-level; a rank that raises fails the call with its traceback."""
    mp.spawn(_rank_process, args=(world, free_port(), worker, args), nprocs=world, join=True)


def _rank_process(rank: int, world: int, port: int, worker: Callable[..., None], args: tuple) -> None:
    """One rank's whole life. A barrier before `destroy_process_group`: no rank tears down its gloo pairs (rank 0
    also hosts the TCP store) while a peer is still in a collective or in its own teardown. Then the process ends
    at once (`os._exit(0)`): the group outlives `destroy_process_group` (after one vocab-parallel loss it still has
    about ten more references than after an idle init and destroy), and a gloo group freed during interpreter
    finalization, in no set order, can abort the rank after its work is done and saved ("terminate called without
    an active exception", SIGABRT: the chunked-head two-rank test's flake)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # only after a clean run: an exception above reaches mp.spawn with its traceback


def _store_result(rank: int, world: int, target: Callable[..., Any], results: Any, args: tuple) -> None:
    results[rank] = target(*args)


def spawn(target: Callable[..., Any], *args: Any, world: int = 2) -> dict[int, Any]:
    """Run `target(*args)` on `world` gloo ranks; {rank: return value}. `target` must be module-level."""
    with mp.Manager() as manager:
        results = manager.dict()
        spawn_ranks(_store_result, target, results, args, world=world)
        return dict(results)


def train_run(config: dict[str, Any], resume: bool = False) -> dict[str, Any]:
    """Train (in this process or on a spawned rank); the per-step losses and the last eval loss."""
    from fastlm.engine.trainer import Trainer

    summary = Trainer(RunConfig.model_validate(config)).train(resume=resume)
    return {"losses": summary.losses, "eval_loss": summary.eval_loss}


def final_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights of the run's latest checkpoint (written by rank 0 in a distributed run)."""
    directory = Path(RunConfig.model_validate(config).run.directory) / "checkpoints"
    return load_file(str(load_latest_checkpoint(directory).path / MODEL_FILE))


def max_rel_err(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Largest ||a - b|| / ||b|| over the tensors of two state dicts with the same names."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    return max(float((actual[k].double() - expected[k].double()).norm() / expected[k].double().norm()) for k in expected)


def torchrun(arguments: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc-per-node 2 ARGUMENTS` on 127.0.0.1 with a free port, from the repo root."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *arguments,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
