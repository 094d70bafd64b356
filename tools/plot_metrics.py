"""Draw a run's JSONL metrics to a PNG: every series a user reads, one panel per quantity.

    python tools/plot_metrics.py RUN_DIR [--out FILE]

Reads RUN_DIR/metrics.jsonl (what every fastlm run writes) and writes RUN_DIR/metrics.png by default.
Panels: train and eval loss, each loss child (when there are several), DPO rewards and accuracy, RL reward
(per function too) and eval reward/accuracy, reward spread, advantages, completion lengths and the share cut
at the budget, clip fractions, entropy, KL, the sampler-vs-trainer log-prob gap and importance weights,
tokens/s, seconds per step (rollout / train), gradient norm and learning rate; then every other logged series
(a loss child's own metrics) in a panel of its own. Panels whose keys the run never logged are left out; a
run with none of them is an error. Each panel has its own linear
y axis with tick values (a log axis only where a series spans orders of magnitude); an RL run's
supervised warm-up is shaded and its end marked on every panel.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

from fastlm.logging.jsonl import read_metrics  # noqa: E402

Series = dict[str, tuple[list[float], list[float]]]  # key -> (steps, values)

# panel title -> pattern of the keys it draws, in the order the panels appear
PANELS: dict[str, str] = {
    "loss": r"^(train|eval)/loss$",
    "loss per child": r"^train/loss/.+$",
    "DPO rewards (beta x log-ratio)": r"^train/dpo/rewards/(chosen|rejected|margins)$",
    "DPO accuracy (chosen > rejected)": r"^train/dpo/rewards/accuracies$",
    "reward": r"^(train/reward|eval/reward|eval/accuracy|train/rewards/[^/]+/mean)$",
    "reward spread (group std, share of groups with one reward)": r"^train/(reward_std|frac_reward_zero_std|rewards/[^/]+/std)$",
    "advantages": r"^train/advantage/(std|min|max)$",
    "completion length (tokens)": r"^train/completions/(mean|min|max)_length$",
    "completions cut at rl.max_new_tokens": r"^train/completions/clipped_ratio$",
    "clip fraction": r"^train/[^/]+/clip_ratio/(low|high|region)_mean$",
    "entropy": r"^train/[^/]+/entropy$",
    "KL": r"^train/[^/]+/kl(_old)?$",
    "sampler vs trainer log-prob gap (logp_diff)": r"^train/sampling/logp_diff/(mean|max)$",
    "importance weights": r"^train/sampling/importance_ratio/(mean|min|max)$",
    "tokens/s": r"^train/tokens_per_second$",
    "seconds per step (timing)": r"^train/timing/.+$",
    "gradient norm": r"^train/grad_norm$",
    "learning rate": r"^train/lr$",
}
# Bookkeeping, not series: the step itself, the warm-up flag (drawn as shading), counters.
NOT_SERIES = re.compile(r"^(step|time|train/step|train/rl/warmup|train/rl/rollouts|train/skipped_steps"
                        r"|train/rewards/[^/]+/none_count)$")
WARMUP_KEY = "train/rl/warmup"


def series(records: list[dict], pattern: str) -> Series:
    """key -> (steps, values) for every numeric key matching `pattern`, in step order."""
    found: Series = {}
    regex = re.compile(pattern)
    for record in records:
        for key, value in record.items():
            if regex.match(key) and isinstance(value, (int, float)) and math.isfinite(value):
                steps, values = found.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(value)
    return dict(sorted(found.items()))


def panels_of(records: list[dict]) -> dict[str, Series]:
    """The panels this run has data for. Loss children get a panel each, and only when there are several
    (a lone child is train/loss): their scales differ by orders of magnitude (z_loss next to GRPO's ~0)."""
    panels: dict[str, Series] = {}
    claimed: set[str] = set()
    for title, pattern in PANELS.items():
        found = series(records, pattern)
        claimed |= set(found)
        if title == "loss per child":
            if len(found) > 1:
                panels.update({f"{key} (unweighted)": {key: values} for key, values in found.items()})
        elif found:
            panels[title] = found
    if panels:  # every other logged series (a child's own metrics, ...) in a panel of its own
        others = series(records, r".*")
        panels.update({key: {key: values} for key, values in others.items()
                       if key not in claimed and not NOT_SERIES.match(key)})
    return panels


def warmup_end(records: list[dict]) -> float | None:
    """Where an RL run's supervised warm-up ends (between its last warm-up step and its first RL step)."""
    warmup = [r["step"] for r in records if r.get(WARMUP_KEY) == 1.0]
    policy = [r["step"] for r in records if r.get(WARMUP_KEY) == 0.0]
    if not warmup or not policy:
        return None
    return (max(warmup) + min(policy)) / 2


def _y_scale(found: Series) -> str:
    """log only for positive series spanning more than two decades (z_loss next to CE); linear otherwise."""
    values = [v for _, vs in found.values() for v in vs]
    if min(values) > 0 and max(values) / min(values) > 100:
        return "log"
    return "linear"


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the PNG and return its path."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no metrics file (is {run_dir} a fastlm run directory?)")
    records = read_metrics(metrics)
    panels = panels_of(records)
    if not panels:
        raise ValueError(f"{metrics}: none of the plotted metrics ({', '.join(PANELS)}) were logged")
    boundary = warmup_end(records)
    columns = 1 if len(panels) == 1 else 2 if len(panels) <= 12 else 3
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 3.0 * rows), squeeze=False, sharex=True)
    for axis, (title, found) in zip(axes.flat, panels.items()):
        for key, (steps, values) in found.items():
            axis.plot(steps, values, label=key, marker="." if len(steps) < 40 else None)
        axis.set_title(title, fontsize=10)
        axis.set_yscale(_y_scale(found))
        axis.set_xlabel("step")
        axis.tick_params(labelbottom=True)  # sharex hides inner tick labels; every panel keeps its own
        axis.grid(alpha=0.3)
        if boundary is not None:
            axis.axvspan(min(r["step"] for r in records) - 0.5, boundary, color="0.85", alpha=0.5, lw=0)
            axis.axvline(boundary, color="0.35", linestyle="--", linewidth=1, label="end of SFT warm-up")
        axis.legend(fontsize=7, loc="best")
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    figure.suptitle(f"{run_dir.name}: {metrics}", fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    out = out or run_dir / "metrics.png"
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
