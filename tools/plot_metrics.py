"""Draw a run's JSONL metrics to a PNG: loss per child, reward, clip fraction, entropy (and eval reward).

    python tools/plot_metrics.py RUN_DIR [--out FILE]

Reads RUN_DIR/metrics.jsonl (what every fastlm run writes) and writes RUN_DIR/metrics.png by default.
Panels whose keys the run never logged are left out; a run with none of them is an error.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

from fastlm.logging.jsonl import read_metrics  # noqa: E402

# panel title -> pattern of the keys it draws
PANELS: dict[str, str] = {
    "loss per child": r"^train/loss/.+$",
    "reward": r"^(train/reward|eval/reward|eval/accuracy)$",
    "clip fraction": r"^train/[^/]+/clip_ratio/(low|high|region)_mean$",
    "entropy": r"^train/[^/]+/entropy$",
}


def series(records: list[dict], pattern: str) -> dict[str, tuple[list[float], list[float]]]:
    """key -> (steps, values) for every key matching `pattern`, in step order."""
    found: dict[str, tuple[list[float], list[float]]] = {}
    regex = re.compile(pattern)
    for record in records:
        for key, value in record.items():
            if regex.match(key) and value is not None:
                steps, values = found.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(value)
    return dict(sorted(found.items()))


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the PNG and return its path."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no metrics file (is {run_dir} a fastlm run directory?)")
    records = read_metrics(metrics)
    panels = {title: found for title, pattern in PANELS.items() if (found := series(records, pattern))}
    if not panels:
        raise ValueError(f"{metrics}: none of the plotted metrics ({', '.join(PANELS)}) were logged")
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for axis, (title, found) in zip(axes[:, 0], panels.items()):
        for key, (steps, values) in found.items():
            axis.plot(steps, values, label=key, marker="." if len(steps) < 30 else None)
        axis.set_title(title)
        if title == "loss per child":  # children differ by orders of magnitude (z_loss ~ lse^2) and GRPO goes negative
            axis.set_yscale("symlog", linthresh=0.1)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("step")
    figure.tight_layout()
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
