"""On-policy distillation against GRPO alone and offline KD on one GPU (issue 55, item 4): a qwen3-1.7b teacher, a
qwen3-0.6b student, the built-in arithmetic-chain task, the same steps and seeds for every student arm.

    python tools/bench_opd.py --out $OUT/bench_opd.json --plot $OUT/bench_opd.png        # CUDA, the issue's run
    python tools/bench_opd.py --teacher runs/my-teacher ...     # skip the teacher's training: any path fastlm loads
    python tools/bench_opd.py --cpu-smoke --out /tmp/opd.json   # CPU: tiny presets, a few steps, every arm
    python tools/bench_opd.py --arms none --keep-teacher runs/opd_teacher   # the teacher alone, kept for a later
                                                                            # --teacher runs/opd_teacher/checkpoints

The setup: the presets' shapes with the byte tokenizer (vocab 260; a random init is useless, so both models are
trained here), task arithmetic_chain (2 steps, operands <= 5), G = --group completions of up to --new-tokens tokens
for each of --prompts prompts per rollout, temperature 1, one optimizer step per rollout, sampler old log-probs.

1. The teacher (unless --teacher): --teacher-warmup supervised steps on task demonstrations (the RL trainer's
   warm-up), then --teacher-steps GRPO steps; its checkpoint is the students' teacher, its final greedy eval
   reward the target.
2. The student, from the same seed and the same --student-warmup supervised steps in every arm, then --steps steps:
   - `opd`: on-policy distillation, rl.teacher objective reverse_kl (the per-token reverse KL as the advantage,
     reward_weight 0: Thinking Machines' form);
   - `gkd`: rl.teacher objective gkd, the distillation child's generalized JSD (beta --beta) on its own samples;
   - `grpo`: GRPO alone on the task reward;
   - `kd`: offline KD: the same distillation child (forward KL to the teacher) on fixed task demonstrations
     (correct answers, fresh ones each step) instead of the student's samples, the teacher's head input added to
     them as gkd does (rl/teacher.py `add_teacher_heads`).

Recorded per arm: the greedy eval reward every --eval-every steps (and at the start), the medians of step seconds,
teacher seconds (its scoring or head input, inside the rollout; gkd's and kd's teacher logits inside the head are
training time), the teacher's share of the step (the issue's goal: <= 30%), trained tokens/s; the first step that
reaches 90% of the teacher's eval reward. The JSON (`--out`, rewritten after each arm so a time-boxed run keeps
what finished) and the plot (`--plot`, eval reward by step per arm, the teacher's as a line) go where asked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.data.offline_rl import PolicySample  # noqa: E402
from fastlm.data.tasks import demonstrations  # noqa: E402
from fastlm.engine.trainer import Trainer  # noqa: E402
from fastlm.rl.packing import pack_policy_samples, split_into_batches  # noqa: E402
from fastlm.rl.rollout import Rollout  # noqa: E402
from fastlm.rl.stream import RolloutStream  # noqa: E402
from fastlm.rl.teacher import add_teacher_heads  # noqa: E402
from fastlm.run_config.loader import load_config  # noqa: E402
from fastlm.training.registry import build_trainer  # noqa: E402

PRESETS = ROOT / "configs" / "presets"
TASK = {"type": "arithmetic_chain", "steps": 2, "max_operand": 5}
ARMS = ("opd", "gkd", "grpo", "kd")


def run_config(name: str, preset: str, args: argparse.Namespace, work: Path, warmup: int, steps: int,
               teacher: str | None = None, arm: str = "grpo") -> Any:
    """One run's config: the preset's shape, byte vocab, the task, G, lengths, batch and the arm's teacher."""
    budget = max(args.new_tokens, 64) + 128  # the warm-up demonstrations (prompt + worked answer) are < 100 tokens
    losses: dict[str, Any] = {"grpo": {"type": "grpo", "eps_low": 0.2, "eps_high": 0.2}}
    rl: dict[str, Any] = {
        "task": TASK, "group_size": args.group, "prompts_per_rollout": args.prompts, "updates_per_rollout": 1,
        "temperature": 1.0, "max_new_tokens": args.new_tokens, "scale_rewards": "group", "format_reward": 0.1,
        "warmup_steps": warmup, "warmup_noise": 0.3, "warmup_demonstrations": args.demonstrations,
        "lr_scale": args.rl_lr_scale, "eval_prompts": args.eval_prompts, "log_completions": 0,
        "backend": {"type": "native", "cuda_graph": args.device == "cuda"}, "old_logprobs": "sampler"}
    if arm == "opd":
        rl["teacher"] = {"path": teacher, "objective": "reverse_kl", "reward_weight": 0.0}
    elif arm in ("gkd", "kd"):
        rl["teacher"] = {"path": teacher, "objective": "gkd", "reward_weight": 0.0}
        kl = {"kl": "jsd", "beta": args.beta} if arm == "gkd" else {"kl": "forward"}
        losses["distillation"] = {"type": "distillation", **kl}
    body = {
        "base": str(PRESETS / f"{preset}.yaml"),
        "run": {"name": name, "seed": args.seed, "output_dir": str(work)},
        "model": {"vocab_size": 260, "max_seq_len": budget, "head": {"losses": losses}},
        "data": {"seq_len": budget, "micro_batch_size": args.micro_batch},
        "optimizer": {"lr": args.lr, "weight_decay": 0.0},
        "schedule": {"warmup_steps": min(10, warmup), "decay": "constant"},
        "trainer": {"steps": warmup + steps, "grad_accumulation": args.grad_accumulation, "device": args.device,
                    "log_every": 1, "eval_every": 0, "checkpoint_every": 0},
        "rl": rl,
        "logging": {"wandb": {"enabled": False}, "progress": False, "jsonl": False},
    }
    path = work / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(body))
    return load_config(path, [])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def eval_reward(trainer: Trainer) -> float:
    return trainer.objective.evaluate(trainer.step)["eval/reward"]


def offline_kd(trainer: Trainer, seed: int) -> None:
    """The `kd` arm: each 'rollout' is a fresh set of the task's correct demonstrations (as many samples as a
    rollout has), packed as rollouts are, with the teacher's head input; the policy child sees zero advantages."""
    setup, teacher = trainer.objective.setup, trainer.objective.teacher
    assert setup is not None and teacher is not None
    count = setup.config.prompts_per_rollout * setup.config.group_size

    stream: RolloutStream = trainer.objective.loader

    def next_rollout(step: int) -> None:
        started = time.perf_counter()
        shown = demonstrations(setup.task, count, 0.0, seed + 7919 * (stream.rollouts + 1))
        samples = []
        for problem in shown:
            answer = setup.tokenizer.encode(problem.answer, eos=True)
            samples.append(PolicySample(setup.tokenizer.encode(problem.prompt, bos=True), answer, 0.0,
                                        old_logp=[0.0] * len(answer)))
        batches = split_into_batches(pack_policy_samples(samples, setup.seq_len, setup.tokenizer.pad_id,
                                                         setup.micro_batches), setup.micro_batches)
        packed = time.perf_counter()
        add_teacher_heads(batches, teacher)
        _sync()
        seconds = {"sampling": packed - started, "reward": 0.0, "teacher": time.perf_counter() - packed,
                   "old_logprob": 0.0}
        stream.start(Rollout(batches, {"reward": 0.0}, [], seconds))
        for phase, value in seconds.items():
            trainer.objective.phase_seconds[phase] += value
        trainer.objective.rollout_seconds += sum(seconds.values())

    trainer.objective.next_rollout = next_rollout  # type: ignore[method-assign]


def train_arm(name: str, config: Any, args: argparse.Namespace, warmup: int, steps: int, arm: str) -> dict[str, Any]:
    """Warm-up, then `steps` timed steps with the greedy eval every --eval-every steps (and as they start)."""
    trainer = build_trainer(config)
    if arm == "kd":
        offline_kd(trainer, args.seed)
    for _ in range(warmup):
        trainer.train_step()
    trainer.runner.settle()
    evals = [(0, eval_reward(trainer))]
    timed: list[dict[str, float]] = []
    stream = trainer.objective.loader
    pad = trainer.tokenizer.pad_id
    for step in range(1, steps + 1):
        trainer.objective.phase_seconds = dict.fromkeys(trainer.objective.phase_seconds, 0.0)
        _sync()
        started = time.perf_counter()
        trainer.train_step()
        trainer.runner.settle()
        trainer.runner.take_read_values()
        _sync()
        total = time.perf_counter() - started
        trained = sum(int((batch.input_ids != pad).sum()) for batch in stream.batches)
        timed.append({"step_seconds": total, "teacher_seconds": trainer.objective.phase_seconds["teacher"],
                      "sampling_seconds": trainer.objective.phase_seconds["sampling"], "trained_tokens": trained,
                      "sampled_reward": stream.rewards[-1]})
        if step % args.eval_every == 0 or step == steps:
            evals.append((step, eval_reward(trainer)))
        print(f"{name} step {step}: {timed[-1]} eval {evals[-1]}", file=sys.stderr, flush=True)
    median = {key: statistics.median(t[key] for t in timed[args.skip:] or timed) for key in timed[0]}
    result = {"arm": arm, "preset": config.model.type, "eval_rewards": evals, "steps": timed,
              "step_seconds": median["step_seconds"], "teacher_seconds": median["teacher_seconds"],
              "teacher_share": median["teacher_seconds"] / max(median["step_seconds"], 1e-9),
              "tokens_per_second": median["trained_tokens"] / max(median["step_seconds"], 1e-9)}
    if arm == "teacher":  # its weights only: the optimizer's moments (2x the model in fp32) are never read again
        trainer.optimizer.state.clear()
        result["checkpoint"] = str(trainer.save())
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def first_reaching(evals: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, reward in evals if reward >= target), None)


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib absent: no plot", file=sys.stderr)
        return
    for arm in report["arms"]:
        steps, rewards = zip(*arm["eval_rewards"], strict=True)
        plt.plot(steps, rewards, marker="o", label=arm["arm"])
    if report.get("teacher_eval") is not None:
        plt.axhline(report["teacher_eval"], color="gray", linestyle="--", label="teacher")
    plt.xlabel("student step (after its warm-up)")
    plt.ylabel("greedy eval reward")
    plt.title(f"{report['student_preset']} student, {report['teacher_preset']} teacher")
    plt.legend()
    plt.savefig(path, dpi=120)


def save(report: dict[str, Any], path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher-preset", default="qwen3-1.7b")
    parser.add_argument("--student-preset", default="qwen3-0.6b")
    parser.add_argument("--teacher", default=None, help="a trained teacher (fastlm run, checkpoint, HF folder); "
                        "default: train one here")
    parser.add_argument("--teacher-warmup", type=int, default=80, help="the teacher's supervised warm-up steps")
    parser.add_argument("--teacher-steps", type=int, default=10, help="the teacher's GRPO steps after it")
    parser.add_argument("--student-warmup", type=int, default=10, help="every student arm's supervised warm-up")
    parser.add_argument("--steps", type=int, default=15, help="student steps per arm after the warm-up")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {ARMS}; none: the teacher only")
    parser.add_argument("--keep-teacher", type=Path, default=None, help="train the teacher in this folder (its "
                        "checkpoints/ then serve --teacher in a later call) instead of a temporary one")
    parser.add_argument("--beta", type=float, default=0.5, help="gkd's generalized JSD beta")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48, help="answers are < 30 tokens")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--grad-accumulation", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4, help="the warm-ups' (from random init)")
    parser.add_argument("--rl-lr-scale", type=float, default=0.2, help="RL lr = --lr x this")
    parser.add_argument("--demonstrations", type=int, default=4096)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the timing medians")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny presets on CPU, a few short steps, every arm")
    parser.add_argument("--out", type=Path, default=None, help="the report as JSON")
    parser.add_argument("--plot", type=Path, default=None, help="eval reward by step per arm, as PNG")
    args = parser.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
    if args.cpu_smoke:
        for name, value in (("teacher_preset", "tiny-llama"), ("student_preset", "qwen2-tiny"), ("teacher_warmup", 2),
                            ("teacher_steps", 1), ("student_warmup", 1), ("steps", 2), ("group", 2), ("prompts", 2),
                            ("new_tokens", 8), ("micro_batch", 2), ("grad_accumulation", 2), ("demonstrations", 16),
                            ("eval_prompts", 4), ("eval_every", 1), ("skip", 0)):
            setattr(args, name, value)
    elif args.device != "cuda":
        parser.error("the benchmark needs CUDA (or --cpu-smoke)")
    arms = [] if args.arms == "none" else args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {ARMS}")
    report: dict[str, Any] = {"teacher_preset": args.teacher_preset, "student_preset": args.student_preset,
                              "task": TASK, "args": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
                              "arms": []}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        teacher = args.teacher
        if teacher is None:
            config = run_config("teacher", args.teacher_preset, args, args.keep_teacher or work, args.teacher_warmup,
                                args.teacher_steps)
            trained = train_arm("teacher", config, args, args.teacher_warmup, args.teacher_steps, "teacher")
            teacher = trained.pop("checkpoint")
            report["teacher_checkpoint"] = teacher
            report["teacher_run"] = trained
            report["teacher_eval"] = trained["eval_rewards"][-1][1]
        else:
            config = run_config("teacher_eval", args.teacher_preset, args, work, 0, 1)
            probe = build_trainer(load_config(Path(work / "teacher_eval.yaml"), [f"run.init_path={teacher}"]))
            report["teacher_eval"] = eval_reward(probe)
            del probe
        save(report, args.out)
        for arm in arms:
            config = run_config(f"student_{arm}", args.student_preset, args, work, args.student_warmup, args.steps,
                                teacher, arm)
            result = train_arm(arm, config, args, args.student_warmup, args.steps, arm)
            result["first_step_within_10pct_of_teacher"] = first_reaching(result["eval_rewards"],
                                                                          0.9 * report["teacher_eval"])
            report["arms"].append(result)
            save(report, args.out)
    print(f"teacher {args.teacher_preset}: eval reward {report['teacher_eval']:.3f}")
    print(f"{'arm':5} {'eval start':>10} {'eval end':>8} {'90% at':>6} {'step s':>7} {'teacher %':>9} {'tok/s':>8}")
    for row in report["arms"]:
        reached = row["first_step_within_10pct_of_teacher"]
        print(f"{row['arm']:5} {row['eval_rewards'][0][1]:10.3f} {row['eval_rewards'][-1][1]:8.3f} "
              f"{'-' if reached is None else reached!s:>6} {row['step_seconds']:7.2f} "
              f"{100 * row['teacher_share']:9.1f} {row['tokens_per_second']:8.0f}")
    if args.plot is not None:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
