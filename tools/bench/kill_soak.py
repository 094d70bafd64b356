"""Kill soak: many SIGKILLs of a real `fastlm train` (seeded random times, startup, every checkpoint fault
point), each followed by checkpoint verification, then a resume to the end compared bit for bit with an
uninterrupted run. Prints the figures recorded in docs/reliability.md.

    python tools/bench/kill_soak.py --kills 50 --seed 0 [--json OUT.json]

Kills are grouped in chains of `--per-chain` (one run directory each, resumed after every kill) so every
chain ends in a full-length run whose losses can be compared. CPU only, one thread per process.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "reliability"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from crash_harness import FAULT_POINTS, STEPS, kill_chain, reference_losses, write_config  # noqa: E402


def _plan(rng: random.Random, length: int) -> list[str]:
    """Mostly random-time kills, with startup kills and each fault point (at a random save) mixed in; the
    first is always random (it makes the chain's first checkpoint)."""
    kinds = ["random"] * 4 + ["startup"] + list(FAULT_POINTS)
    picks = ["random", *(rng.choice(kinds) for _ in range(length - 1))]
    return [kind if kind in ("random", "startup") else f"{kind}@{rng.randint(1, 3)}" for kind in picks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--per-chain", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.1, help="seconds after a checkpoint (random kills)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    started = time.monotonic()
    kinds: Counter[str] = Counter()
    in_checkpoint_write = chains = mismatched_steps = 0
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        reference = reference_losses(root / "reference")
        done = 0
        while done < args.kills:
            plan = _plan(rng, min(args.per_chain, args.kills - done))
            config = write_config(root / f"chain{chains}", f"chain{chains}", steps=STEPS)
            result = kill_chain(config, plan, seed=rng.randrange(2**31), max_delay_s=args.max_delay)
            kinds.update(kill.how.split("@")[0] for kill in result.kills)
            in_checkpoint_write += sum(1 for kill in result.kills if kill.temp_dirs_left)
            mismatched_steps += sum(1 for step, loss in result.losses.items() if reference.get(step) != loss)
            mismatched_steps += len(set(reference) ^ set(result.losses))
            done += len(result.kills)
            chains += 1
            print(f"chain {chains}: {[k.how for k in result.kills]} -> checkpoints "
                  f"{[k.checkpoint_step for k in result.kills]}", flush=True)
    figures = {
        "kills": done, "chains": chains, "by_kind": dict(kinds), "kills_leaving_a_temp_dir": in_checkpoint_write,
        "unloadable_latest_checkpoints": 0,  # kill_chain raises on the first one
        "steps_with_different_loss": mismatched_steps, "steps_per_run": STEPS,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2), encoding="utf-8")
    return 0 if mismatched_steps == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
