"""Checks of the machine and the files a config names, run before `train` touches the run directory.

`cross_check` (fastlm/run_config/checks.py) judges the config alone; these look outside it: do the data
files open, do the init / teacher / reference checkpoints hold loadable weights (headers only, no
tensor is read), does this machine have the device, kernel and world size the config asks for.
`fastlm validate`, `train --dry-run` and `train` call `preflight_issues` once per start (a trainer does not
call it again), so validate catches what train would fail on before its first step.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import TypeAdapter, ValidationError
from safetensors import safe_open

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.config import PREPARED_SOURCE_TYPES
from fastlm.data.prepared import prepared_source_issues
from fastlm.engine.checkpoint import (
    LATEST_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    CheckpointError,
    changed_model_keys,
    complete_checkpoints,
    latest_pointer,
    model_changes,
    read_manifest,
)
from fastlm.engine.memory import memory_issues
from fastlm.logging.logger import METRICS_FILE
from fastlm.models.config import ModelConfig
from fastlm.system.run_dir import ASIDE_DIR, LOCK_FILE, REPLACED_DIR, open_run_file

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig


def preflight_issues(config: RunConfig) -> list[ConfigIssue]:
    """Every problem `train` would hit before its first step that the config alone cannot show."""
    issues = [*_data_file_issues(config), *_checkpoint_issues(config), *_device_issues(config), *_world_issues(config)]
    return issues or memory_issues(config)


# --- data files ------------------------------------------------------------------------------------
def _data_file_issues(config: RunConfig) -> list[ConfigIssue]:
    issues = prepared_source_issues(config) if config.data.source.type in PREPARED_SOURCE_TYPES else _file_issues(
        config.data.source, "data.source")
    evaluation = config.data.eval_source
    if evaluation is not None and evaluation.type not in PREPARED_SOURCE_TYPES:
        issues += _file_issues(evaluation, "data.eval_source")
    return issues


def _file_issues(source: object, field: str) -> list[ConfigIssue]:
    """The source's file (`path`) opens, if it has one."""
    path = getattr(source, "path", None)
    problem = None if path is None else _unreadable(Path(path))
    if problem is None:
        return []
    return [ConfigIssue(f"{field}.path", problem, path, hint="point it at an existing, readable file")]


def _unreadable(path: Path) -> str | None:
    """Why `path` cannot be read as a data file, or None when it can."""
    if not path.exists():
        return f"data file not found (looked in {path.absolute().parent})"
    if not path.is_file():
        return "not a file"
    try:
        with path.open("rb") as handle:
            handle.read(1)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    return None


# --- checkpoints -----------------------------------------------------------------------------------
def _checkpoint_issues(config: RunConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for child, need in config.model.head.frozen_models():  # the loss children's declared teachers and references
        if need.path is None or not Path(need.path).exists():  # a missing path is cross_check's "checkpoint not found"
            continue
        problem = fastlm_checkpoint_problem(Path(need.path), config)
        if problem is not None:
            issues.append(ConfigIssue(f"{child}.{need.key}", problem, need.path, hint="point it at a run, checkpoints/ "
                                      "or step-* directory of a finished fastlm run with the same tokenizer"))
    init = Path(config.run.init_path) if config.run.init_path is not None else None
    if init is not None and (init / MANIFEST_FILE).is_file():  # a fastlm checkpoint (resolved by the loader)
        problem = init_checkpoint_problem(init, config)
        if problem is not None:
            issues.append(ConfigIssue("run.init_path", problem, config.run.init_path,
                                      hint="make the model section the checkpoint's (see its manifest.json), or start "
                                      "from another run"))
    elif init is not None and init.is_dir():
        problem = hf_weights_problem(init)
        if problem is not None:
            issues.append(ConfigIssue("run.init_path", problem, config.run.init_path,
                                      hint="point it at a folder with config.json + *.safetensors (save_pretrained)"))
    return issues


def init_checkpoint_problem(step_dir: Path, config: RunConfig) -> str | None:
    """Why a fastlm checkpoint cannot start this run: it is not loadable, or its model is not this run's model
    section (`changed_model_keys`: adapters may be added on a base that has none)."""
    problem = fastlm_checkpoint_problem(step_dir, config)
    if problem is not None:
        return problem
    stored = json.loads((step_dir / MANIFEST_FILE).read_text(encoding="utf-8"))["config"]["model"]
    current = config.model.model_dump(mode="json")
    changed = changed_model_keys(stored, current, init=True)
    if not changed:
        return None
    shown = "; ".join(f"model.{key}: checkpoint {stored.get(key)!r}, this run {current.get(key)!r}" for key in changed[:4])
    return f"its model differs from this run's ({shown})"


def resolve_step_dir(path: Path) -> Path | None:
    """The checkpoint a run dir, `checkpoints/` dir, `latest` file or `step-*` dir names (the frozen-model
    loader's rules), or None. Reads the `latest` pointer only; verifying hashes is the loader's job."""
    if path.is_file() and path.name == LATEST_FILE:
        path = path.parent
    if (path / MANIFEST_FILE).is_file():
        return path
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    target = latest_pointer(path) if path.is_dir() else None  # confined to `path`, never a link
    if target is not None and (target / MANIFEST_FILE).is_file():
        return target
    steps = sorted(p for p in path.glob("step-*") if (p / MANIFEST_FILE).is_file()) if path.is_dir() else []
    return steps[-1] if steps else None


def fastlm_checkpoint_problem(path: Path, config: RunConfig) -> str | None:
    """Why the frozen model at `path` would not load into this run, read from the manifest and the
    safetensors header (names and shapes against the model built on meta), or None."""
    from fastlm.models.decoder import build_model

    step_dir = resolve_step_dir(path)
    if step_dir is None:
        return "no fastlm checkpoint there (no manifest.json in it, its checkpoints/ or its `latest`)"
    try:
        section = json.loads((step_dir / MANIFEST_FILE).read_text(encoding="utf-8"))["config"]["model"]
        model_config = TypeAdapter(ModelConfig).validate_python(section)
    except (OSError, ValueError, KeyError, TypeError, ValidationError, RecursionError) as error:
        return f"{step_dir / MANIFEST_FILE} holds no valid model config ({type(error).__name__})"
    if model_config.lora is not None:
        return (f"{step_dir} holds a LoRA run's adapters, not a whole model: start from its base, or merge them "
                f"first (fastlm convert --from {step_dir.parent.parent} --merge-lora --to-hf DIR)")
    if model_config.vocab_size != config.model.vocab_size:
        return f"its model.vocab_size is {model_config.vocab_size}, this run's is {config.model.vocab_size}"
    if model_config.max_seq_len < config.data.seq_len:
        return f"its model.max_seq_len {model_config.max_seq_len} is shorter than data.seq_len {config.data.seq_len}"
    expected = {name: tuple(t.shape) for name, t in build_model(model_config, device="meta").state_dict().items()}
    stored = _safetensors_shapes(step_dir / MODEL_FILE)
    if isinstance(stored, str):
        return stored
    # Tied embeddings are stored once (save_model), so a stored name must be expected, not the reverse.
    wrong = sorted(name for name, shape in stored.items() if expected.get(name) != shape)
    if wrong or not stored:
        return f"{step_dir / MODEL_FILE} does not fit its own model config (tensors {wrong[:3] or 'none'})"
    return None


def hf_weights_problem(directory: Path) -> str | None:
    """Why a HF checkpoint folder holds no loadable safetensors weights (headers parsed), or None."""
    from fastlm.models.hf import weight_files

    try:
        files = weight_files(directory)  # bounded reads, every path confined to the folder
    except ConfigError as error:
        return "; ".join(issue.message for issue in error.issues)
    if not files:
        return "no *.safetensors weights in it"
    for file in files:
        shapes = _safetensors_shapes(file)
        if isinstance(shapes, str):
            return shapes
    return None


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]] | str:
    """name -> shape from the header alone, or why the file is not loadable."""
    if not file.is_file():
        return f"{file} is missing"
    try:
        with safe_open(str(file), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as error:  # noqa: BLE001 - safetensors raises several types for a damaged header
        return f"{file} is not a readable safetensors file ({error})"


# --- the run directory ------------------------------------------------------------------------------
CHECKPOINT_DIR = "checkpoints"
EARLIER_RUN_FIX = "continue it with --resume, choose another run.name, or pass run.overwrite=true to start over"


def earlier_run(run_dir: Path) -> list[str]:
    """What makes the directory hold an earlier run: a checkpoint, or a logged metrics record. An empty
    metrics.jsonl or only `.tmp-*` leftovers (a start killed before its first step) do not count. An earlier
    run that a killed `run.overwrite=true` set aside counts as back in place: the trainer's start puts it back
    (`recover_replaced`) unless the new run reached a checkpoint; nothing is moved here."""
    aside = _set_aside(run_dir)
    found = []
    for name, holds in ((METRICS_FILE, _logged), (CHECKPOINT_DIR, _checkpointed)):
        if holds(aside / name if aside is not None and os.path.lexists(aside / name) else run_dir / name):
            found.append(name)
    return found


def _logged(metrics: Path) -> bool:
    return metrics.is_file() and metrics.stat().st_size > 0


def _checkpointed(checkpoints: Path) -> bool:
    return checkpoints.is_dir() and any(not p.name.startswith(".") for p in checkpoints.iterdir())


def _set_aside(run_dir: Path) -> Path | None:
    """The folder of an earlier run that `recover_replaced` would put back (its entries replace the new run's)."""
    if (run_dir / REPLACED_DIR).is_dir() and not complete_checkpoints(run_dir / CHECKPOINT_DIR):
        return run_dir / REPLACED_DIR
    return run_dir / ASIDE_DIR if (run_dir / ASIDE_DIR).is_dir() else None


def run_dir_issues(config: RunConfig, resume: bool) -> list[ConfigIssue]:
    """What `train` (with or without --resume) would refuse about the run directory: an earlier run that a
    fresh start would mix with, or nothing to resume. `preflight_issues` leaves these out: the trainer decides
    them itself, holding the directory's lock."""
    run_dir = Path(config.run.directory)
    if _locked(run_dir / LOCK_FILE):  # another process trains there: the trainer's lock names it (exit 1)
        return []
    earlier = earlier_run(run_dir)
    if resume and CHECKPOINT_DIR not in earlier:
        return [ConfigIssue("run.name", f"--resume needs a checkpoint, and {run_dir / CHECKPOINT_DIR} holds none",
                            config.run.name, hint="train without --resume to start the run")]
    if not resume and earlier and not config.run.overwrite:
        return [ConfigIssue("run.name", f"run directory {run_dir} already holds an earlier run ({', '.join(earlier)})",
                            config.run.name, hint=EARLIER_RUN_FIX)]
    if resume:
        return _resume_model_issues(config, run_dir / CHECKPOINT_DIR)
    return []


def _resume_model_issues(config: RunConfig, checkpoints: Path) -> list[ConfigIssue]:
    """--resume with a model section that no checkpoint of the run has (a changed LoRA rank, say): an issue per
    changed field, naming both values and the fix (what the trainer's restore would refuse). Checkpoints whose
    manifest does not read are left to the trainer, which skips them."""
    current = config.model.model_dump(mode="json")
    newest: tuple[str, list[tuple[str, Any, Any]]] | None = None
    for path in reversed(complete_checkpoints(checkpoints)):
        try:
            _, _, stored = read_manifest(path)
        except CheckpointError:
            continue
        changes = model_changes(stored.get("model") if isinstance(stored.get("model"), dict) else {}, current)
        if not changes:
            return []  # the trainer resumes from this one
        newest = newest or (path.name, changes)
    if newest is None:
        return []
    name, changes = newest
    return [ConfigIssue(field, f"is {old!r:.60} in checkpoint {name} (a resume continues its model)", new,
                        hint=f"resume with {field}={old!r:.60}, or use the new value in a new run (another run.name, "
                        "or run.overwrite=true)") for field, old, new in changes]


def _locked(path: Path) -> bool:
    """Whether another process holds the run directory's lock (a shared probe, released at once). A lock that is
    not a regular file (a link, a FIFO, a folder) is opened as the trainer opens it, without following or
    blocking: a `RunDirError` naming it and the fix, as the trainer would raise."""
    try:
        fd = open_run_file(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# --- this machine ----------------------------------------------------------------------------------
def _device_issues(config: RunConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    cuda = torch.cuda.is_available()
    device = config.trainer.device
    if device == "cuda" and not cuda:
        issues.append(ConfigIssue("trainer.device", "no CUDA device is available on this machine", device,
                                  hint="use 'auto' or 'cpu'"))
    on_gpu = cuda and device != "cpu"
    if config.model.head.use_triton is True:
        if importlib.util.find_spec("triton") is None:
            issues.append(ConfigIssue("model.head.use_triton", "triton is not installed", True,
                                      hint="pip install triton, or set use_triton: null (picks the compiled path)"))
        elif not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            where = "trainer.device is 'cpu'" if cuda else "this machine has no CUDA GPU"
            issues.append(ConfigIssue("model.head.use_triton", f"the fused Triton kernel needs a CUDA GPU, and {where}",
                                      True, hint="set use_triton: null (Triton on GPU, compiled PyTorch elsewhere) "
                                      "or false; TRITON_INTERPRET=1 runs it on CPU, slowly, for tests"))
    issues += config.model.device_issues(on_gpu)
    if config.distributed.backend == "nccl" and not on_gpu:
        issues.append(ConfigIssue("distributed.backend", "nccl needs CUDA, and this run is on CPU", "nccl",
                                  hint="use 'auto' or 'gloo'"))
    return issues


def _world_issues(config: RunConfig) -> list[ConfigIssue]:
    """The world size (the process group's, else torchrun's WORLD_SIZE, else 1) against the parallel layout,
    and GPUs per node."""
    issues: list[ConfigIssue] = []
    grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if grouped else int(os.environ.get("WORLD_SIZE", "1"))
    tp = config.distributed.tensor_parallel
    if world % tp:
        started = f"the job has {world} processes" if grouped or "WORLD_SIZE" in os.environ else "this is a single process"
        issues.append(ConfigIssue("distributed.tensor_parallel", f"must divide the world size, and {started}", tp,
                                  hint=f"start with `torchrun --nproc-per-node {tp} -m fastlm train ...` "
                                  "(or a multiple), or set tensor_parallel: 1"))
    if config.distributed.data_parallel == "fsdp" and tp > 1:
        issues.append(ConfigIssue("distributed.data_parallel", "fsdp with tensor_parallel > 1 is not supported", "fsdp",
                                  hint="use ddp, or tensor_parallel: 1"))
    lag = config.rl.max_policy_lag if config.rl is not None else 0
    if lag and world > 1:
        issues.append(ConfigIssue("rl.max_policy_lag", f"rollouts sampled ahead run on a worker thread of one process, "
                                  f"and the job has {world} processes (a sampler rank beside trainer ranks is not built "
                                  "yet)", lag, hint="set rl.max_policy_lag: 0, or run one process"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and config.trainer.device != "cpu" and local_rank >= torch.cuda.device_count():
        issues.append(ConfigIssue("trainer.device", f"LOCAL_RANK {local_rank} has no GPU: this node has "
                                  f"{torch.cuda.device_count()}", config.trainer.device,
                                  hint="start at most one process per GPU (torchrun --nproc-per-node)"))
    return issues
