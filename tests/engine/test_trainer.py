"""Trainer: the loss falls on the generated corpus, accumulation equals one big batch, non-finite handling."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from host_reads import host_reads
from wandb_reader import read_wandb_run

from fastlm.data.batch import Batch
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.objective import SupervisedObjective
from fastlm.engine.step import NonFiniteError
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.schema import RunConfig
from fastlm.system.run_dir import RunDirError
from tests.step_helpers import forward_backward, next_batches

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_llama_learns_and_logs(tiny_config: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = tiny_config(
        "learn",
        trainer={"steps": 30, "log_every": 5, "eval_every": 15},
        logging={"wandb": {"enabled": True}},
        model={"head": {"losses": {"ce": {"type": "cross_entropy"}, "z": {"type": "z_loss", "weight": 1e-3}}}},
    )
    summary = Trainer(config).train()
    print(f"loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}, eval {summary.eval_loss:.4f}")
    assert summary.steps == 30 and len(summary.losses) == 30
    assert summary.first_loss > 5.0  # ~ln(260) at init
    assert summary.last_loss < summary.first_loss - 2.0
    assert summary.eval_loss is not None and summary.eval_loss < 3.5

    records = read_metrics(summary.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]
    expected = {"train/loss", "train/loss/ce", "train/loss/z", "train/lr", "train/grad_norm", "train/tokens_per_second",
                "train/step", "train/skipped_steps"}
    assert expected <= set(records[0])
    assert "train/z/lse" in records[0]  # child metrics, summed over micro-batches
    assert "eval/loss" in records[2] and "eval/loss" not in records[0]
    for record, window in zip(records, range(0, 30, 5)):  # each record: the mean of its window's 5 steps, as HF/TRL
        assert record["train/loss"] == pytest.approx(sum(summary.losses[window:window + 5]) / 5, rel=1e-12)
    for record in records:  # the total is the weighted sum of the children
        combined = record["train/loss/ce"] + 1e-3 * record["train/loss/z"]
        assert abs(record["train/loss"] - combined) <= 1e-6 * record["train/loss"]

    (run_file,) = (summary.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, wandb_config = read_wandb_run(run_file)
    assert [row["step"] for row in history] == [r["step"] for r in records]
    for row, record in zip(history, records):
        assert set(row) == set(record) - {"time"}
        assert all(row[k] == record[k] for k in row)
    assert "compiled PyTorch path" in wandb_config["loss_implementation"]


def test_accumulation_equals_one_big_batch(tiny_config: Callable[..., RunConfig]) -> None:
    """2 micro-batches of 4 give the loss and the gradient of one batch of 8 (summation order aside).
    Gradients are compared, not the weights after AdamW: its first step is ~lr*sign(g), which turns
    float32 reordering noise on near-zero gradient entries into lr-sized differences."""
    no_clip = {"grad_clip": None}
    accumulated = Trainer(tiny_config("acc", data={"micro_batch_size": 4}, optimizer=no_clip,
                                      trainer={"steps": 1, "grad_accumulation": 2}))
    big = Trainer(tiny_config("big", data={"micro_batch_size": 8}, optimizer=no_clip, trainer={"steps": 1}))
    first = forward_backward(accumulated, next_batches(accumulated))
    second = forward_backward(big, next_batches(big))
    loss_error = abs(first.loss - second.loss) / abs(second.loss)
    grad_error = max(
        float((a.grad - b.grad).abs().max() / b.grad.abs().max())
        for a, b in zip(accumulated.model.parameters(), big.model.parameters(), strict=True)
    )
    print(f"accumulation 2x4 vs 1x8: loss rel err {loss_error:.2e}, max grad rel err (per tensor) {grad_error:.2e}")
    assert loss_error < 1e-6
    assert grad_error < 1e-5
    initial = [p.detach().clone() for p in big.model.parameters()]
    big.runner.optimizer_step(second, big.step + 1)
    assert not any(torch.equal(a, b) for a, b in zip(big.model.parameters(), initial))  # the step moved them


def _poison(trainer: Trainer) -> None:
    """A real non-finite state: a NaN in the final norm makes every logit (and the loss) NaN."""
    with torch.no_grad():
        trainer.model.final_norm.weight[0] = math.nan


def test_nonfinite_skip_step(tiny_config: Callable[..., RunConfig]) -> None:
    trainer = Trainer(tiny_config("skip", trainer={"steps": 3, "nonfinite": "skip_step"}))
    _poison(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    summary = trainer.train()
    assert summary.skipped_steps == 3
    assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(trainer.model.parameters(), before))
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    assert [r["train/skipped_steps"] for r in records] == [1, 2, 3]


def test_nonfinite_stop_writes_checkpoint_and_raises(tiny_config: Callable[..., RunConfig]) -> None:
    trainer = Trainer(tiny_config("stop", trainer={"steps": 3, "nonfinite": "stop"}))
    _poison(trainer)
    with pytest.raises(NonFiniteError, match="non-finite loss at step 1.*saved to"):
        trainer.train()
    assert (trainer.checkpoint_dir / "step-00000000" / "manifest.json").is_file()


class _LateBadLabel(SupervisedObjective):
    """A label outside the vocabulary that appears after the host check (in the per-micro-batch hook),
    so only the loss's own value checks can catch it."""

    def batches(self, step: int) -> list[Batch]:
        self.step = step  # the step these batches are for
        return super().batches(step)

    def prepare(self, batch: Batch) -> Batch:
        batch = super().prepare(batch)
        labels = batch.labels.clone()
        flat = labels.reshape(-1)
        flat[int((flat != -100).nonzero()[0, 0])] = self.config.model.vocab_size
        return dataclasses.replace(batch, labels=labels)


def test_loss_value_checks_are_read_once_per_step_and_before_the_update(tiny_config: Callable[..., RunConfig]) -> None:
    trainer = Trainer(tiny_config("late-bad", trainer={"steps": 2, "grad_accumulation": 2}), objective=_LateBadLabel)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=r"targets.labels\[\d+\] = 260 is outside the vocabulary"):
        trainer.train()
    assert trainer.step == 0
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), before))  # no optimizer step ran


def test_late_bad_label_between_read_points_holds_every_update_back(tiny_config: Callable[..., RunConfig]) -> None:
    """Read points every 4 steps, a bad label from step 2 on: steps 2-4 make no update (the flag stays on
    the device), the read at step 4 raises the loss's error naming step 2, the weights are step 1's."""

    class BadFromStepTwo(_LateBadLabel):
        def prepare(self, batch: Batch) -> Batch:
            return super().prepare(batch) if self.step >= 1 else SupervisedObjective.prepare(self, batch)

    trainer = Trainer(tiny_config("late-bad-4", trainer={"steps": 8, "log_every": 4}), objective=BadFromStepTwo)
    trainer.train_step()
    after_first = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step()
    trainer.train_step()
    assert trainer.step == 3 and len(trainer.runner.pending) == 3  # nothing read yet: steps 1-3 are pending
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), after_first))
    with pytest.raises(ValueError, match=r"step 2: targets.labels\[\d+\] = 260 is outside the vocabulary"):
        trainer.train_step()
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), after_first))
    assert not trainer.runner.halted  # the flag that held the updates back is cleared with its error


def test_nonfinite_stop_between_read_points_saves_the_weights_before_it(tiny_config: Callable[..., RunConfig]) -> None:
    """`nonfinite: stop` with a read every 3 steps: a NaN gradient at step 2 holds back steps 2 and 3; the read
    (inside step 3, before it counts) saves step 1's weights as the checkpoint of step 2 and names step 2."""
    trainer = Trainer(tiny_config("stop-late", trainer={"steps": 6, "log_every": 3, "nonfinite": "stop"}))
    weight = trainer.model.final_norm.weight
    weight.register_hook(lambda grad: grad * math.nan if trainer.step == 1 else grad)
    trainer.train_step()
    after_first = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(NonFiniteError, match=r"non-finite gradient norm at step 2 .*saved to .*; step 3 made no update"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), after_first))
    loaded = load_latest_checkpoint(trainer.checkpoint_dir)
    assert loaded.step == 2
    saved = loaded.model_state()
    assert all(torch.equal(saved[name], p) for (name, _), p in zip(trainer.model.named_parameters(), after_first))


def test_steps_between_read_points_read_nothing_back(
    tiny_config: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host never waits for the device inside a step: between read points nothing is read back (the
    chunked head, the default, scales its gradients by grad_output on the device); a read point reads
    everything pending in one transfer."""
    trainer = Trainer(tiny_config("reads", trainer={"steps": 8, "log_every": 4, "grad_accumulation": 2}))
    trainer.train_step()
    with host_reads(monkeypatch) as reads:
        trainer.train_step()
        trainer.train_step()
    print(f"steps 2-3 (no read point): {reads}")
    assert sum(reads.sites.values()) == 0, f"host reads inside a step: {reads}"
    with host_reads(monkeypatch) as reads:
        trainer.train_step()
    print(f"step 4 (read point): {reads}")
    assert reads.at("engine/step_scalars.py", "wait") == 1 and sum(reads.sites.values()) == 1, str(reads)
    assert [values.step for values in trainer.runner.take_read_values()] == [1, 2, 3, 4]


def test_init_path_starts_from_hf_weights(tiny_config: Callable[..., RunConfig], tmp_path) -> None:
    from fastlm.models.hf import export_hf

    source = Trainer(tiny_config("source", run={"seed": 7}))
    export_hf(source.model, tmp_path / "hf", source.tokenizer)
    started = Trainer(tiny_config("started", run={"init_path": str(tmp_path / "hf")}))
    assert all(torch.equal(a, b) for a, b in zip(source.model.state_dict().values(),
                                                 started.model.state_dict().values(), strict=True))


def test_fresh_run_refuses_an_earlier_runs_directory_unless_overwrite(tmp_path: Path) -> None:
    """Running again without --resume must not append to the old metrics or prune its checkpoints."""
    from fastlm.run_config.loader import load_config

    overrides = [f"run.output_dir={tmp_path}/run", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
                 "model.num_kv_heads=1", "model.intermediate_size=64", "data.seq_len=16", "data.micro_batch_size=2",
                 "data.source.num_documents=40", "trainer.steps=2", "trainer.eval_every=0", "logging.wandb.enabled=false",
                 "logging.progress=false", "schedule.warmup_steps=0"]
    Trainer(load_config(None, overrides)).train()
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = metrics.read_text()
    with pytest.raises(RunDirError, match="already holds an earlier run .*--resume.*run.overwrite=true"):
        Trainer(load_config(None, overrides)).train()
    assert metrics.read_text() == before
    summary = Trainer(load_config(None, [*overrides, "run.overwrite=true"])).train()
    assert summary.steps == 2
    assert len(metrics.read_text().splitlines()) == len(before.splitlines())


def test_resume_with_more_steps_continues_the_decay(tiny_config: Callable[..., RunConfig],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Resuming a 6-step cosine run at step 4 with trainer.steps 10: the lr goes on down from where it was (no
    jump back up), reaches min_lr_ratio x peak at the end, says so in one line; a second resume keeps the curve."""
    from fastlm.engine.optim import lr_multiplier

    sections = {"schedule": {"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1}}
    short = tiny_config("extend", trainer={"steps": 4, "checkpoint_every": 2}, **sections)
    Trainer(short).train()
    resumed = Trainer(tiny_config("extend", trainer={"steps": 10, "checkpoint_every": 2}, **sections))
    summary = resumed.train(resume=True)
    assert summary.steps == 10
    err = capsys.readouterr().err
    assert "trainer.steps is 10, the checkpoint's run went to 4: the lr decay continues from step 4" in err
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(summary.run_dir / "metrics.jsonl")}
    peak = 1e-2
    assert lrs[4] == pytest.approx(peak * lr_multiplier(3, 4, short.schedule))  # the first run's own schedule
    restarted = peak * lr_multiplier(4, 10, short.schedule)  # what a schedule for 10 steps alone would use at step 5
    print("lr by step:", {k: f"{v:.2e}" for k, v in lrs.items()}, f"(a restarted decay: {restarted:.2e} at step 5)")
    assert lrs[5] <= lrs[4] + 1e-12 and lrs[5] < restarted
    assert all(lrs[s + 1] <= lrs[s] + 1e-12 for s in range(4, 10))
    assert resumed.scheduler.get_last_lr()[0] == pytest.approx(0.1 * peak)  # the end of the decay at step 10
    banner = resumed.banner()
    assert f"fastlm: run extend in {summary.run_dir} (resumed from step 10, steps 11-10)" in banner
    assert "M parameters, on cpu in float32" in banner and "fastlm: loss: compiled PyTorch path" in banner
    # the anchor is in the checkpoints: resuming at step 6 with the same total gives the same lr for step 7-10
    again = Trainer(tiny_config("extend", trainer={"steps": 10, "checkpoint_every": 2}, **sections))
    again.resume()
    assert again.step == 10 and again.checkpoints.decay_anchor == resumed.checkpoints.decay_anchor


def test_export_hf_writes_a_transformers_folder_at_the_end(tiny_config: Callable[..., RunConfig]) -> None:
    """trainer.export_hf: true leaves RUN_DIR/hf, which transformers loads to the trained model's logits."""
    import transformers

    trainer = Trainer(tiny_config("export", trainer={"steps": 2, "export_hf": True}))
    summary = trainer.train()
    exported = summary.run_dir / "hf"
    assert (exported / "config.json").is_file() and (exported / "model.safetensors").is_file()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    ids = torch.randint(0, 256, (2, 16))
    trainer.model.cpu().eval()  # the trainer's device is CUDA where there is one; the inputs are on the CPU
    with torch.no_grad():
        ours, theirs = trainer.model.logits(ids), hf_model(ids).logits
    error = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"exported HF logits vs fastlm: max rel err {error:.2e}")
    assert error < 1e-5


def test_eval_source_is_a_separate_eval_set(tiny_config: Callable[..., RunConfig], tmp_path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """data.eval_source: eval/loss reads that file's documents, and the train source is used whole."""
    from fastlm.commands.main import main

    story = tmp_path / "held_out.txt"
    story.write_text("".join(f"Held-out story number {i} about a red kite.\n\n" for i in range(60)))
    split = Trainer(tiny_config("split", trainer={"steps": 1}))
    separate = Trainer(tiny_config("separate", trainer={"steps": 2, "eval_every": 2},
                                   data={"eval_source": {"type": "text", "path": str(story)}}))
    assert len(separate.objective.loader.rows) > len(split.objective.loader.rows)  # nothing held out of the train source
    text = separate.tokenizer.decode(separate.objective.eval_set[0].input_ids[0].tolist())
    assert "story number" in text  # seq_len 32 cuts the packed documents anywhere
    summary = separate.train()
    assert summary.eval_loss is not None and math.isfinite(summary.eval_loss)
    base = ["validate", str(ROOT / "configs/tiny.yaml"), f"run.output_dir={tmp_path}/v"]
    assert main([*base, f"data.eval_source={{type: text, path: {tmp_path}/missing.txt}}"]) == 2
    assert "data.eval_source.path: data file not found" in capsys.readouterr().err
    assert main(["validate", str(ROOT / "configs/grpo.yaml"), f"run.output_dir={tmp_path}/v",
                 f"data.eval_source={{type: text, path: {story}}}"]) == 2
    assert "data.eval_source: an online RL run is judged by eval/reward" in capsys.readouterr().err
