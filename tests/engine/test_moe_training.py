"""MoE models in training: the router losses join the step's loss as transformers adds its `aux_loss`;
accumulation gives one big batch's gradient for the head and the z-loss; packed documents, activation
checkpointing, compiled blocks and the full-logits head change nothing; SFT, DPO and GRPO (rollouts on the
KV-cache generator) train end to end on CPU and log the router losses and expert loads."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml

from fastlm.data.batch import Batch
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.engine.step import step_normalizers
from fastlm.layers.moe import MoEMLP
from fastlm.logging.jsonl import read_metrics
from fastlm.losses.spec import LossNormalizers, LossTargets
from fastlm.models.decoder import build_model
from fastlm.models.hf import export_hf
from fastlm.models.mixtral.config import MixtralConfig
from fastlm.run_config.schema import RunConfig
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
VOCAB = 260
MOE = {"num_experts": 4, "top_k": 2, "ffn_size": 24, "aux_loss_coef": 0.05, "z_loss_coef": 0.01}


def _model(seed: int = 0, **moe: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32,
                           init_std=0.2, moe={**MOE, **moe})
    return build_model(config).train()


def _targets(ids: torch.Tensor, padding: torch.Tensor | None = None) -> tuple[LossTargets, float]:
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[:, :3] = -100  # a masked prompt
    if padding is not None:  # nothing predicts padding, nothing is predicted from it
        labels[torch.roll(padding, -1, dims=1) | padding] = -100
    flat = labels.reshape(-1)
    return LossTargets(labels=flat), float((flat != -100).sum())


def _right_padded(ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(B, S) padding flags of rows holding `lengths` real tokens each; `ids` gets the byte tokenizer's PAD there."""
    padding = torch.arange(ids.shape[1])[None] >= torch.tensor(lengths)[:, None]
    ids[padding] = ByteTokenizer().pad_id
    return padding


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in a)


@pytest.mark.parametrize("padded", [False, True])
def test_step_loss_equals_transformers_with_router_logits(tmp_path: Path, padded: bool) -> None:
    """Cross-entropy + aux_loss_coef * balance loss, as MixtralForCausalLM(labels, output_router_logits=True)
    on the exported weights; the gradients of the routers, experts and embeddings too (fp32). The z-loss
    is off for the comparison (transformers has none). Right-padded rows: transformers given the attention
    mask (padding out of its balance loss), fastlm the padding flags."""
    model = _model(z_loss_coef=0.0)
    directory = export_hf(model, tmp_path / "hf", ByteTokenizer())
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").train()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    padding = _right_padded(ids, [12, 7]) if padded else None
    targets, tokens = _targets(ids, padding)
    result = model(ids, targets, LossNormalizers(tokens=tokens), padding=padding)
    result.loss.backward()
    labels = targets.labels.view(2, 12)
    # transformers shifts the labels itself: hand it the unshifted ones (the first column is never a label)
    unshifted = torch.cat([torch.full((2, 1), -100), labels[:, :-1]], dim=1)
    mask = None if padding is None else (~padding).long()
    expected = reference(ids, attention_mask=mask, labels=unshifted, output_router_logits=True)
    expected.loss.backward()
    print(f"loss {float(result.loss.detach()):.6f} vs transformers {float(expected.loss.detach()):.6f}; "
          f"moe_aux {float(result.losses['moe_aux'].detach()):.6f} vs {float(expected.aux_loss):.6f}")
    assert abs(float(result.loss) - float(expected.loss)) < 1e-5
    assert abs(float(result.losses["moe_aux"]) - float(expected.aux_loss)) < 1e-5
    theirs = {name: p.grad for name, p in reference.named_parameters()}
    ours = _grads(model)
    pairs = {"embeddings.tokens.weight": "model.embed_tokens.weight", "lm_head_weight": "lm_head.weight"}
    for layer in range(2):
        hf = f"model.layers.{layer}.mlp"
        pairs |= {f"blocks.{layer}.mlp.router.weight": f"{hf}.gate.weight",
                  f"blocks.{layer}.mlp.gate_up_proj": f"{hf}.experts.gate_up_proj",
                  f"blocks.{layer}.mlp.down_proj": f"{hf}.experts.down_proj"}
    gap = _max_rel({k: ours[k] for k in pairs}, {k: theirs[v].reshape(ours[k].shape) for k, v in pairs.items()})
    print(f"max rel gradient gap (routers, experts, embeddings) {gap:.2e}")
    assert gap < 1e-4
    assert {"moe/layer0/max_over_mean_load", "moe/layer1/idle_experts"} <= set(result.metrics)


def test_accumulation_gives_one_big_batch() -> None:
    """Two micro-batches of right-padded rows against step-wide normalizers (the trainer's: tokens, real routed
    positions): the cross-entropy and z-loss gradient is the big batch's; the balance loss is the micro-batches'
    mean weighted by their real tokens (documented)."""
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(2))
    padding = _right_padded(ids, [12, 9, 5, 11])
    batches = [Batch(ids[r], _targets(ids[r], padding[r])[0].labels.view(-1, 12), torch.zeros_like(ids[r]), padding[r])
               for r in (slice(0, 1), slice(1, 4))]  # uneven micro-batches
    normalizers = step_normalizers(batches)
    targets, tokens = _targets(ids, padding)
    assert normalizers.positions == 12 + 9 + 5 + 11 and normalizers.tokens == tokens
    big, accumulated = _model(aux_loss_coef=0.0), _model(aux_loss_coef=0.0)
    big(ids, targets, LossNormalizers(tokens=tokens), padding=padding).loss.backward()
    z = 0.0
    for batch in batches:
        result = accumulated(batch.input_ids, batch.targets(), normalizers, padding=batch.padding)
        result.loss.backward()
        z += float(result.losses["moe_router_z"])
    with torch.no_grad():
        whole = big(ids, targets, LossNormalizers(tokens=tokens), padding=padding)
    gap = _max_rel(_grads(accumulated), _grads(big))
    print(f"accumulated vs big batch: max rel gradient gap {gap:.2e}; z {z:.6f} vs {float(whole.losses['moe_router_z']):.6f}")
    assert gap < 1e-5 and abs(z - float(whole.losses["moe_router_z"])) < 1e-6 * abs(z)
    model = _model()
    total = sum(float(model(b.input_ids, b.targets(), normalizers, padding=b.padding).losses["moe_aux"]) for b in batches)
    alone = [float(model(b.input_ids, b.targets(), LossNormalizers(tokens=1.0), padding=b.padding).losses["moe_aux"])
             for b in batches]
    assert math.isclose(total, (12 * alone[0] + 25 * alone[1]) / 37, rel_tol=1e-6)


def test_appended_padding_leaves_a_rows_router_losses_alone() -> None:
    """A row's router losses and expert loads are the same alone and with padding appended (flagged); unflagged,
    the padding would count."""
    model = _model()
    row = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    padded = torch.cat([row, torch.full((1, 5), ByteTokenizer().pad_id)], dim=1)
    padding = torch.arange(14)[None] >= 9
    alone = model(row, _targets(row)[0], LossNormalizers(tokens=1.0))
    flagged = model(padded, _targets(padded, padding)[0], LossNormalizers(tokens=1.0), padding=padding)
    unflagged = model(padded, _targets(padded, padding)[0], LossNormalizers(tokens=1.0))
    router_values = [name for name in [*alone.losses, *alone.metrics] if name.startswith("moe")]
    assert len(router_values) == 2 + 2 * 2  # both losses, two metrics for each of the two layers
    for name in router_values:
        want = {**alone.losses, **alone.metrics}[name]
        torch.testing.assert_close({**flagged.losses, **flagged.metrics}[name], want, rtol=1e-6, atol=1e-7, msg=name)
    assert abs(float(unflagged.losses["moe_router_z"]) - float(alone.losses["moe_router_z"])) > 1e-4


def test_packed_checkpointed_and_full_logits_agree() -> None:
    """One packed row of two documents equals the documents alone (logits); activation checkpointing and the
    full-logits head give the same loss and gradients as the plain chunked-head forward (padded rows)."""
    model = _model()
    first, second = torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 7))
    packed = torch.cat([first, second], dim=1)
    documents = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        together = model.logits(packed, documents)
        apart = torch.cat([model.logits(first), model.logits(second)], dim=1)
    assert float((together - apart).abs().max()) < 1e-5
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    padding = _right_padded(ids, [12, 8])
    targets, tokens = _targets(ids, padding)
    normalizers = LossNormalizers(tokens=tokens)
    model(ids, targets, normalizers, padding=padding).loss.backward()
    reference = _grads(model)
    variants = {"checkpointing": lambda m: m.set_activation_checkpointing(True),
                "full logits": None}
    for name, change in variants.items():
        if change is None:
            full = model.config.model_dump() | {"head": {**model.config.head.model_dump(), "logits_memory_mib": 0}}
            other = build_model(MixtralConfig.model_validate(full)).train()
            other.load_state_dict(model.state_dict())
            assert not other.head.chunked
        else:
            other = copy.deepcopy(model)
            other.zero_grad()
            change(other)
        other(ids, targets, normalizers, padding=padding).loss.backward()
        gap = _max_rel(_grads(other), reference)
        print(f"{name}: max rel gradient gap {gap:.2e}")
        assert gap < 1e-5, name


def test_compiled_blocks_keep_the_moe_layer_eager() -> None:
    """Compiled blocks (dynamo; the MoE forward is `torch.compiler.disable`d, so each block's graph breaks
    around it) give the eager loss and gradients, router losses included (padded rows)."""
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    padding = _right_padded(ids, [10, 12])
    targets, tokens = _targets(ids, padding)
    eager = model(ids, targets, LossNormalizers(tokens=tokens), padding=padding)
    eager.loss.backward()
    compiled = copy.deepcopy(model)
    compiled.zero_grad()
    compiled.compile_blocks(backend="eager")
    result = compiled(ids, targets, LossNormalizers(tokens=tokens), padding=padding)
    result.loss.backward()
    assert torch.allclose(result.loss, eager.loss) and _max_rel(_grads(compiled), _grads(model)) < 1e-6
    assert "moe_aux" in result.losses


def _moe_model_section(section: dict[str, Any]) -> dict[str, Any]:
    """A shipped config's model section as a tiny Mixtral (the head and the sizes kept)."""
    keep = {key: section[key] for key in ("hidden_size", "num_heads", "num_kv_heads", "max_seq_len", "head", "vocab_size")
            if key in section}
    return {**keep, "type": "mixtral", "num_layers": 1, "moe": MOE}


def _run(name: str, tmp_path: Path, steps: int, **sections: Any) -> list[dict]:
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    base = yaml.safe_load((CONFIGS / raw.pop("base")).read_text())
    model = {**base["model"], **raw.get("model", {})}
    model.pop("intermediate_size", None)
    config = {**raw, "model": _moe_model_section({**model, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1})}
    config["run"] = {**raw["run"], "output_dir": f"{tmp_path}/{{name}}"}
    config["trainer"] = {**raw["trainer"], "steps": steps, "log_every": 1, "eval_every": 0, "checkpoint_every": 0,
                         "eval_batches": 1}
    config["data"] = {**raw["data"], "micro_batch_size": 4}
    config["logging"] = {"wandb": {"enabled": False}, "progress": False}
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    run_config = RunConfig.model_validate(config)
    summary = build_trainer(run_config).train()
    return read_metrics(summary.run_dir / "metrics.jsonl")


@pytest.mark.parametrize(("name", "sections"), [
    ("tiny", {"data": {"seq_len": 32, "source": {"type": "generated", "num_documents": 200}}}),
    ("dpo", {"data": {"source": {"type": "generated_preferences", "num_pairs": 40, "max_operand": 4}}}),
    ("grpo", {"rl": {"warmup_steps": 1, "prompts_per_rollout": 2, "group_size": 4, "eval_prompts": 0,
                     "updates_per_rollout": 1}, "trainer": {"grad_accumulation": 1}}),
])
def test_sft_dpo_grpo_train_an_moe_model(name: str, sections: dict[str, Any], tmp_path: Path) -> None:
    records = _run(name, tmp_path, 3, **sections)
    assert len(records) == 3
    for record in records:
        assert {"train/loss/moe_aux", "train/loss/moe_router_z", "train/moe/layer0/max_over_mean_load",
                "train/moe/layer0/idle_experts"} <= set(record), sorted(record)
        assert math.isfinite(record["train/loss"]) and record["train/loss/moe_aux"] >= 1.0 - 1e-6  # an even router gives k/k
        assert 1.0 - 1e-6 <= record["train/moe/layer0/max_over_mean_load"] <= MOE["num_experts"] / MOE["top_k"] + 1e-6
    print(f"{name}: moe_aux {[round(r['train/loss/moe_aux'], 4) for r in records]}")


def test_moe_layers_are_found_by_the_loss_hook() -> None:
    assert len([m for m in _model().modules() if isinstance(m, MoEMLP)]) == 2


def test_moe_steps_read_nothing_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Router losses and expert-load metrics stay on the device: between read points an MoE step on the
    grouped (or gather) path reads nothing back; the loop, the CPU reference, reads each layer's counts."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from host_reads import host_reads

    from fastlm.engine.trainer import Trainer

    def trainer(backend: str) -> Trainer:
        return Trainer(RunConfig.model_validate({
            "run": {"name": backend, "output_dir": f"{tmp_path}/{{name}}", "seed": 0},
            "model": {"type": "mixtral", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                      "max_seq_len": 16, "moe": {**MOE, "backend": backend}},
            "data": {"source": {"type": "generated", "num_documents": 60}, "seq_len": 16, "micro_batch_size": 2},
            "trainer": {"steps": 8, "log_every": 4, "grad_accumulation": 2, "eval_every": 0, "checkpoint_every": 0,
                        "device": "cpu"},
            "logging": {"wandb": {"enabled": False}, "progress": False}}))

    for backend, expected in (("grouped", 0), ("gather", 0), ("loop", 2)):
        run = trainer(backend)
        run.train_step()
        with host_reads(monkeypatch) as reads:
            run.train_step()
        print(f"{backend}: {reads}")
        assert sum(reads.sites.values()) == expected and reads.at("layers/moe.py", "expert_mlp") == expected, str(reads)
