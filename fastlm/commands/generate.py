"""`fastlm generate RUN_DIR|CHECKPOINT --prompt TEXT`: what a trained model writes, with the run's tokenizer.

The model, its head's logit transform and the sampling defaults come from the checkpoint's own config
(the `rl:` section's temperature, top_p and max_new_tokens where the run has one); flags override them.
Sampling is the KV-cache generator rollouts use (fastlm/generation), so a completion here is one a rollout
could draw; the sampling generator lives on the model's device (a seed repeats on that device).

The checkpoint is read as hostile as a resume reads it: the manifest is validated (fastlm/engine/checkpoint.py),
weights that do not fit the model its config describes are one line, sampling options are checked (finite
temperature >= 0, top_p in (0, 1]), and a reader that closes stdout early (`| head`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError

from fastlm.commands.errors import exit_status
from fastlm.commands.generate_arguments import DEFAULT_MAX_NEW_TOKENS
from fastlm.config.errors import ConfigError
from fastlm.data.chat import ChatError, check_messages, encode_chat_prompt
from fastlm.data.datasets import DataError, jsonl_records
from fastlm.data.tokenizer import Message, Tokenizer
from fastlm.engine.checkpoint import LATEST_FILE, CheckpointError, read_manifest
from fastlm.engine.config import TrainerConfig
from fastlm.engine.convert import load_fastlm
from fastlm.engine.lora_training import load_lora_run
from fastlm.engine.preflight import resolve_step_dir
from fastlm.engine.runtime import autocast_dtype, select_device
from fastlm.generation import Generator, SamplingOptions
from fastlm.models.decoder import DecoderLM, build_model
from fastlm.run_config.schema import RunConfig


@dataclass
class LoadedModel:
    model: DecoderLM
    tokenizer: Tokenizer  # the run's, as training built it
    run: RunConfig | None  # the run config stored with the checkpoint (None for a `convert --to` folder)
    origin: Path


def load_model(source: Path, device: torch.device) -> LoadedModel:
    """The newest checkpoint's (or a `convert --to` folder's) model with its weights, in eval mode."""
    if source.is_file() and source.name == LATEST_FILE:
        source = source.parent
    if not source.exists():
        raise CheckpointError(f"{source}: no such run directory or checkpoint")
    step_dir = resolve_step_dir(source)
    run = None
    if step_dir is not None:
        _, _, stored = read_manifest(step_dir)
        try:
            run = RunConfig.model_validate(stored)
        except ValidationError:  # an older config layout: the model section alone still loads
            run = None
    model_config, state, tokenizer = load_fastlm(step_dir or source)
    if model_config.lora is not None:  # adapters only: the base comes from run.init_path / run.seed
        model = load_lora_run(str(step_dir or source), "source")[0]
        return LoadedModel(model.to(device).eval(), tokenizer, run, step_dir or source)
    model = build_model(model_config, device="cpu")
    try:
        model.load_state_dict(state)
    except RuntimeError as error:  # a manifest describing another model than its weights
        first = str(error).strip().splitlines()[0][:200]
        raise CheckpointError(f"{step_dir or source}: the weights do not fit the model its config describes ({first}); "
                              "the checkpoint was changed or damaged") from None
    return LoadedModel(model.to(device).eval(), tokenizer, run, step_dir or source)


def read_prompts(texts: list[str], file: Path | None, chat: bool = False) -> list[str | list[Message]]:
    """Prompt texts; with `chat`, a JSONL record may instead hold a multi-turn conversation (`messages`)."""
    prompts: list[str | list[Message]] = list(texts)
    if file is not None:
        if not file.is_file():
            raise DataError(f"{file}: prompts file not found")
        if file.suffix == ".jsonl":
            for line, record in jsonl_records(file):
                if "messages" in record:
                    if not chat:
                        raise DataError(f"{file} line {line}: a conversation ('messages') needs --chat")
                    try:
                        prompts.append(check_messages(record["messages"]))
                    except ChatError as error:
                        raise DataError(f"{file} line {line}: {error}") from None
                    continue
                if not isinstance(record.get("prompt"), str):
                    raise DataError(f"{file} line {line}: needs a string field 'prompt' (keys: {sorted(record)})")
                prompts.append(record["prompt"])
        else:
            prompts += [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise DataError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


def sampling_options(args: argparse.Namespace, loaded: LoadedModel, tokenizer: Tokenizer) -> SamplingOptions:
    """Flags, else the run's rl section, else plain sampling; the head's transform from the model config;
    stop at the tokenizer's EOS."""
    rl = loaded.run.rl if loaded.run is not None else None
    head = loaded.model.config.head

    def pick(flag: float | int | None, field: str, default: float | int) -> float | int:
        return flag if flag is not None else getattr(rl, field) if rl is not None else default

    return SamplingOptions(  # it checks its values (finite temperature >= 0, top_p in (0, 1]): one line
        max_new_tokens=int(pick(args.max_new_tokens, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
        temperature=float(pick(args.temperature, "temperature", 1.0)),
        top_p=float(pick(args.top_p, "top_p", 1.0)),
        top_k=int(pick(args.top_k, "top_k", 0)),
        stop_tokens=(tokenizer.eos_id,),
        logit_scale=head.logit_scale,
        softcap=head.softcap,
    )


def generate_command(args: argparse.Namespace) -> int:
    try:
        prompts = read_prompts(args.prompt, args.prompts_file, args.chat)
        device = select_device_for(args.device)
        loaded = load_model(Path(args.source), device)
        tokenizer = loaded.tokenizer
        options = sampling_options(args, loaded, tokenizer)
        seed = args.seed if args.seed is not None else loaded.run.run.seed if loaded.run is not None else 0
        conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        encoded = [encode_chat_prompt(tokenizer, messages) for messages in conversations] if args.chat else [
            tokenizer.encode(prompt, bos=True) for prompt in prompts]
        room = loaded.model.config.max_seq_len - max(len(p) for p in encoded)
        if room < 1:
            raise DataError(f"the longest prompt is {max(len(p) for p in encoded)} tokens, and the model's "
                            f"max_seq_len is {loaded.model.config.max_seq_len}: shorten it")
        if options.max_new_tokens > room:
            options = dataclasses.replace(options, max_new_tokens=room)
        amp = autocast_dtype(loaded.run.trainer, device) if loaded.run is not None else None
        generator = torch.Generator(device=device).manual_seed(seed)
        completions = Generator(loaded.model, tokenizer, amp).generate(encoded, options, generator)
    except (ConfigError, DataError, CheckpointError, ValueError) as error:
        return exit_status(error)
    print(f"# {loaded.origin}: temperature {options.temperature:g}, top_p {options.top_p:g}, "
          f"max_new_tokens {options.max_new_tokens}, seed {seed}", file=sys.stderr)
    try:
        _print_completions(args, tokenizer, prompts, completions)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader closed stdout (`| head`): nothing more to say, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush goes nowhere
    return 0


def _print_completions(args: argparse.Namespace, tokenizer: Tokenizer, prompts: list[str | list[Message]],
                       completions: list) -> None:
    for index, (prompt, completion) in enumerate(zip(prompts, completions), start=1):
        body = completion.tokens[:-1] if completion.stopped else completion.tokens
        text = tokenizer.decode(body)
        if args.jsonl:
            print(json.dumps({"prompt": prompt, "completion": text, "stopped": completion.stopped}))
        else:
            ending = "stopped at EOS" if completion.stopped else "no EOS: max_new_tokens reached"
            shown = prompt if isinstance(prompt, str) else tokenizer.render_chat(prompt, add_generation_prompt=True)
            print(f"--- {index}: {shown!r} -> {len(completion.tokens)} new tokens, {ending}\n{shown}{text}")


def select_device_for(name: str) -> torch.device:
    try:
        return select_device(TrainerConfig(device=name))
    except RuntimeError as error:
        raise ConfigError(str(error)) from None
