"""GRPO end to end on one GPU: fastlm's RL trainer beside TRL's GRPOTrainer on transformers' model (its
built-in `generate`, no vLLM), same weights, task, reward, G, lengths and batch, in one run.

    python tools/bench_rl.py                      # CUDA: llama-350m (+ qwen3-0.6b when its preset exists)
    python tools/bench_rl.py --presets llama-350m --steps 6 --trl-steps 3 --out bench_rl.json
    python tools/bench_rl.py --cpu-smoke          # CPU: the tiny preset, a few steps, fastlm only
    python tools/bench_rl.py --lags 0,1           # also fastlm with rollouts one policy version ahead (lag 1)

The setup: the preset's shape with the byte tokenizer (vocab 260), the built-in arithmetic-chain task and its
reward (`task_reward`: 1 right, 0.1 well-formed, 0 else), G = --group completions of up to --new-tokens
tokens for each of --prompts prompts per step, temperature 1, one optimizer step per rollout (TRL's
num_iterations 1, steps_per_generation 1), GRPO with eps 0.2, same lr. Neither side recomputes old log-probs:
TRL uses the training forward's own (detached), fastlm the sampler's (`rl.old_logprobs: sampler`;
`--old-logprobs trainer` times the recomputing forward). fastlm first trains --warmup-steps
supervised steps on task demonstrations (so completions stop and rewards vary); those weights are exported
to a Hugging Face folder (fastlm/models/hf.py) that TRL loads, and both sides then run RL steps from them.
TRL is optional: if `trl` does not import, its rows say so and fastlm still runs.

Reported per side and step (medians over the timed steps; the first --skip steps warm up graphs/compile):
seconds per step split into rollout (sampling), reward, old log-prob (the forward that recomputes the
sampler's log-probs, with `--old-logprobs trainer` only) and train (forward, backward, optimizer);
rollout tokens/s = completion tokens sampled / rollout seconds; training tokens/s = prompt +
completion tokens trained / train seconds; episode tokens/s = completion tokens / whole step seconds (the
end-to-end number). Rewards per step go into the JSON (`--out`) for the two reward curves
(`--plot FILE.png` draws them when matplotlib imports).

Completion lengths follow each policy, so the two sides may sample very different amounts (a batch's
generation lasts as long as its longest completion). `--ignore-eos` fixes the work instead: after the
warm-up every completion runs to --new-tokens on both sides (TRL: `min_new_tokens`; fastlm: no stop
token), the equal-work throughput a generation benchmark reports; rewards are then meaningless.

`--lags 0,1` runs fastlm once per `rl.max_policy_lag` (rows `fastlm` and `fastlm-lag1`): with a lag the next
rollout samples on a worker thread while the current one trains, so its rollout column is the time the step
waited for it (reward and old log-prob seconds are inside that overlapped sampling), and the async / sync ratio
of episode tokens/s is printed beside fastlm / TRL.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.data.tokenizer import ByteTokenizer  # noqa: E402
from fastlm.models.hf import export_hf  # noqa: E402
from fastlm.rl.prompts import TaskPrompts, task_reward  # noqa: E402
from fastlm.run_config.loader import load_config  # noqa: E402
from fastlm.training.registry import build_trainer  # noqa: E402

PRESETS = ROOT / "configs" / "presets"
PHASES = ("rollout", "reward", "old_logprob", "train")
TASK = {"type": "arithmetic_chain", "steps": 2, "max_operand": 5}


@dataclass
class Side:
    """One framework's timed RL steps."""

    framework: str
    preset: str
    steps: list[dict[str, float]] = field(default_factory=list)  # per step: phase seconds, tokens, reward
    note: str = ""

    def summary(self, skip: int) -> dict[str, Any]:
        timed = self.steps[skip:] or self.steps
        if not timed:
            return {"framework": self.framework, "preset": self.preset, "note": self.note}
        median = {key: statistics.median(step[key] for step in timed) for key in timed[0]}
        total = sum(median[phase] for phase in PHASES)
        return {
            "framework": self.framework, "preset": self.preset, "timed_steps": len(timed), "note": self.note,
            **{f"{phase}_seconds": median[phase] for phase in PHASES}, "step_seconds": total,
            "completion_tokens_per_step": median["completion_tokens"],
            "rollout_tokens_per_second": median["completion_tokens"] / max(median["rollout"], 1e-9),
            "training_tokens_per_second": median["trained_tokens"] / max(median["train"], 1e-9),
            "episode_tokens_per_second": median["completion_tokens"] / max(total, 1e-9),
            "rewards": [step["mean_reward"] for step in self.steps],
        }


def fastlm_config(preset: str, args: argparse.Namespace, run_dir: Path, device: str, lag: int = 0) -> Any:
    """The benchmark's run config: the preset's shape, byte vocab, the task, G, lengths and batch."""
    budget = max(args.new_tokens, 64) + 128  # prompts up to ~100 byte tokens (chains of 4 steps), answers < 64
    body = {
        "base": str(PRESETS / f"{preset}.yaml"),
        "run": {"name": f"bench_rl_{preset}", "seed": 0, "output_dir": str(run_dir)},
        "model": {"vocab_size": 260, "max_seq_len": budget,
                  "head": {"losses": {"grpo": {"type": "grpo", "eps_low": 0.2, "eps_high": 0.2}}}},
        "data": {"seq_len": budget, "micro_batch_size": args.micro_batch},
        "optimizer": {"lr": args.lr, "weight_decay": 0.0},
        "schedule": {"warmup_steps": 0, "decay": "constant"},
        "trainer": {"steps": args.warmup_steps + args.steps, "grad_accumulation": args.grad_accumulation, "device": device,
                    "log_every": 1, "eval_every": 0, "checkpoint_every": 0},
        "rl": {"task": TASK, "group_size": args.group, "prompts_per_rollout": args.prompts, "updates_per_rollout": 1,
               "temperature": 1.0, "max_new_tokens": args.new_tokens, "scale_rewards": "group",
               "warmup_steps": args.warmup_steps, "warmup_noise": 0.3, "eval_prompts": 0, "log_completions": 0,
               "backend": {"type": "native", "cuda_graph": device == "cuda"}, "old_logprobs": args.old_logprobs,
               "max_policy_lag": lag},
        "logging": {"wandb": {"enabled": False}, "progress": False, "jsonl": False},
    }
    path = run_dir / "bench_rl.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(body))
    return load_config(path, [])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_fastlm(preset: str, args: argparse.Namespace, work: Path, device: str, lag: int = 0) -> tuple[Side, Path]:
    """Warm-up steps, the HF export of those weights (TRL's start), then the timed RL steps."""
    config = fastlm_config(preset, args, work / f"fastlm_{preset}_lag{lag}", device, lag)
    trainer = build_trainer(config)
    side = Side("fastlm" if lag == 0 else f"fastlm-lag{lag}", preset)
    for _ in range(args.warmup_steps):
        trainer.train_step()
    trainer.runner.settle()
    hf_dir = export_hf(trainer.model, work / f"hf_{preset}", ByteTokenizer())
    if args.ignore_eos:  # the warm-up's demonstrations end in EOS; the timed rollouts sample the whole budget
        setup = trainer.objective.setup
        assert setup is not None
        trainer.objective.setup = replace(setup, options=replace(setup.options, stop_tokens=()))
    stream = trainer.objective.loader
    pad = trainer.tokenizer.pad_id
    for _ in range(args.steps):
        trainer.objective.phase_seconds = dict.fromkeys(trainer.objective.phase_seconds, 0.0)
        trainer.objective.rollout_seconds = 0.0
        _sync()
        started = time.perf_counter()
        trainer.train_step()
        trainer.runner.settle()
        trainer.runner.take_read_values()
        _sync()
        total = time.perf_counter() - started
        phases = trainer.objective.phase_seconds
        if lag:  # sampling overlaps training: what the step spent on it is its wait for the rollout
            phases = {"sampling": trainer.objective.rollout_seconds, "reward": 0.0, "old_logprob": 0.0}
        trained = sum(int((batch.input_ids != pad).sum()) for batch in stream.batches)
        completion = sum(int((batch.labels != -100).sum()) for batch in stream.batches)
        side.steps.append({"rollout": phases["sampling"], "reward": phases["reward"],
                           "old_logprob": phases["old_logprob"], "train": total - sum(phases.values()),
                           "completion_tokens": completion, "trained_tokens": trained, "mean_reward": stream.rewards[-1]})
        print(f"fastlm {preset} step {len(side.steps)}: {side.steps[-1]}", file=sys.stderr, flush=True)
    return side, hf_dir


class _Timer:
    """Wraps methods of one object so the seconds spent in each are summed (CUDA synchronised)."""

    def __init__(self, target: Any, names: dict[str, str]) -> None:
        self.seconds = dict.fromkeys(names.values(), 0.0)
        for method, phase in names.items():
            if callable(getattr(target, method, None)):
                setattr(target, method, self._wrap(getattr(target, method), phase))

    def _wrap(self, function: Any, phase: str) -> Any:
        def timed(*arguments: Any, **keywords: Any) -> Any:
            _sync()
            started = time.perf_counter()
            try:
                return function(*arguments, **keywords)
            finally:
                _sync()
                self.seconds[phase] += time.perf_counter() - started
        return timed


def run_trl(preset: str, args: argparse.Namespace, hf_dir: Path, work: Path) -> Side:
    """TRL's GRPOTrainer from the exported weights: same prompts stream, reward, G, lengths, batch and lr."""
    side = Side("trl", preset)
    try:
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    except ImportError as error:
        side.note = f"trl absent ({error}); install trl and its dependencies (see the docstring) to compare"
        return side
    import random

    from fastlm.rl.config import RLConfig
    from fastlm.rl.rollout import rollout_task

    task = rollout_task(RLConfig(task=TASK))
    source, rng = TaskPrompts(task), random.Random(2)
    records = [source.sample(rng) for _ in range(args.prompts * (args.trl_steps + 2))]
    dataset = Dataset.from_list([{"prompt": "<bos>" + r.text, "answer": r.columns["answer"]} for r in records])
    reward = task_reward(task, 0.1)

    def task_reward_function(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                             answer: list[str], **_: Any) -> list[float]:
        # TRL decodes without special tokens; a completion stopped when its ids hold the EOS (as fastlm's rule)
        stopped = [tokenizer.eos_token_id in ids for ids in completion_ids]
        return reward(prompts, completions, stopped, answer)

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, dtype=dtype,
                                                 attn_implementation="sdpa")
    # one generation of prompts x G completions per optimizer step, trained in grad_accumulation micro-batches
    # (as fastlm's rollout); with steps aligned TRL skips the old log-prob forward
    config = trl.GRPOConfig(
        output_dir=str(work / f"trl_{preset}"), per_device_train_batch_size=args.micro_batch,
        num_generations=args.group, max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, beta=0.0,
        epsilon=0.2, num_iterations=1, steps_per_generation=args.grad_accumulation,
        gradient_accumulation_steps=args.grad_accumulation,
        max_steps=args.trl_steps, logging_steps=1, save_strategy="no", report_to=[], bf16=torch.cuda.is_available(),
        use_vllm=False, loss_type="dapo", scale_rewards="group", use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, seed=0, gradient_checkpointing=False,  # fastlm does not checkpoint either
        generation_kwargs={"min_new_tokens": args.new_tokens} if args.ignore_eos else None,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=task_reward_function, args=config, train_dataset=dataset,
                              processing_class=tokenizer)
    timer = _Timer(trainer, {"_generate": "rollout", "_calculate_rewards": "reward"})
    steps = side.steps

    class StepClock(TrainerCallback):
        tokens = 0.0  # TRL's running num_tokens
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            _sync()
            timer.seconds = dict.fromkeys(timer.seconds, 0.0)
            self.started = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            _sync()
            total = time.perf_counter() - self.started
            steps.append({"rollout": timer.seconds["rollout"], "reward": timer.seconds["reward"], "old_logprob": 0.0,
                          "train": total - timer.seconds["rollout"] - timer.seconds["reward"]})

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs and steps and "reward" in logs:
                episodes = args.prompts * args.group
                trained = float(logs["num_tokens"]) - self.tokens  # prompt + completion tokens of this step
                self.tokens = float(logs["num_tokens"])
                steps[-1].update({"mean_reward": float(logs["reward"]), "trained_tokens": trained,
                                  "completion_tokens": float(logs["completions/mean_length"]) * episodes})
                print(f"trl {preset} step {len(steps)}: {steps[-1]}", file=sys.stderr, flush=True)

    trainer.add_callback(StepClock())
    trainer.train()
    side.steps = [s for s in steps if "mean_reward" in s]
    side.note = f"trl {trl.__version__}, transformers generate (sdpa)"
    return side


def save(summaries: list[dict[str, Any]], path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(summaries, indent=2) + "\n")


def plot(sides: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib absent: no plot", file=sys.stderr)
        return
    for side in sides:
        if side.get("rewards"):
            plt.plot(range(1, len(side["rewards"]) + 1), side["rewards"], label=f"{side['framework']} {side['preset']}")
    plt.xlabel("RL step")
    plt.ylabel("mean reward (sampled)")
    plt.legend()
    plt.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=None, help="comma-separated presets (default llama-350m[,qwen3-0.6b])")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (x group completions)")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--grad-accumulation", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=8, help="timed fastlm RL steps")
    parser.add_argument("--trl-steps", type=int, default=4, help="timed TRL steps (each is slow)")
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the medians (warm-up)")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--old-logprobs", choices=("sampler", "trainer"), default="sampler",
                        help="fastlm's rl.old_logprobs (sampler: no recomputing forward, as TRL here)")
    parser.add_argument("--ignore-eos", action="store_true", help="every completion runs to --new-tokens (equal work)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny preset on CPU, a few short steps")
    parser.add_argument("--lags", default="0", help="comma-separated rl.max_policy_lag values for fastlm (e.g. 0,1)")
    parser.add_argument("--out", type=Path, default=None, help="write the summaries (and reward curves) as JSON")
    parser.add_argument("--plot", type=Path, default=None, help="draw both reward curves into this PNG")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
    if args.cpu_smoke:
        args.presets = args.presets or "tiny-llama"
        for name, value in (("group", 2), ("prompts", 2), ("new_tokens", 16), ("micro_batch", 2), ("grad_accumulation", 2),
                            ("warmup_steps", 1), ("steps", 2), ("trl_steps", 2), ("skip", 0)):
            setattr(args, name, value)
    elif device != "cuda":
        parser.error("the benchmark needs CUDA (or --cpu-smoke)")
    if args.prompts * args.group != args.micro_batch * args.grad_accumulation:
        parser.error(f"--prompts x --group ({args.prompts * args.group} completions) must equal --micro-batch x "
                     f"--grad-accumulation ({args.micro_batch * args.grad_accumulation}): TRL trains one generation "
                     "per optimizer step in that many micro-batches")
    presets = (args.presets or "llama-350m" + (",qwen3-0.6b" if (PRESETS / "qwen3-0.6b.yaml").is_file() else "")).split(",")
    summaries = []
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        for preset in presets:
            for lag in sorted(int(value) for value in args.lags.split(",")):
                fastlm_side, hf_dir = run_fastlm(preset, args, work, device, lag)  # the same warm-up: same weights
                summaries.append(fastlm_side.summary(args.skip))
                save(summaries, args.out)  # after each side: a time-boxed run keeps what finished
            if not args.no_trl:
                summaries.append(run_trl(preset, args, hf_dir, work).summary(args.skip))
                save(summaries, args.out)
            torch.cuda.empty_cache() if device == "cuda" else None
    print(f"{'framework':11} {'preset':11} {'rollout s':>9} {'reward s':>8} {'oldlogp s':>9} {'train s':>8} "
          f"{'step s':>8} {'rollout tok/s':>13} {'train tok/s':>11} {'episode tok/s':>13}")
    for row in summaries:
        if "step_seconds" not in row:
            print(f"{row['framework']:11} {row['preset']:11} {row['note']}")
            continue
        print(f"{row['framework']:11} {row['preset']:11} {row['rollout_seconds']:9.2f} {row['reward_seconds']:8.3f} "
              f"{row['old_logprob_seconds']:9.2f} {row['train_seconds']:8.2f} {row['step_seconds']:8.2f} "
              f"{row['rollout_tokens_per_second']:13.0f} {row['training_tokens_per_second']:11.0f} "
              f"{row['episode_tokens_per_second']:13.0f}")
    pairs = {(r["framework"], r["preset"]): r for r in summaries if "step_seconds" in r}
    for preset in presets:
        if ("fastlm", preset) in pairs and ("trl", preset) in pairs:
            ratio = pairs["fastlm", preset]["episode_tokens_per_second"] / pairs["trl", preset]["episode_tokens_per_second"]
            print(f"{preset}: fastlm / TRL end-to-end episode tokens/s = {ratio:.1f}x")
        for (framework, name), row in pairs.items():
            if name == preset and framework.startswith("fastlm-lag") and ("fastlm", preset) in pairs:
                ratio = row["episode_tokens_per_second"] / pairs["fastlm", preset]["episode_tokens_per_second"]
                print(f"{preset}: {framework} / fastlm (synchronous) episode tokens/s = {ratio:.2f}x")
    if args.plot is not None:
        plot(summaries, args.plot)
    return summaries


if __name__ == "__main__":
    main()
