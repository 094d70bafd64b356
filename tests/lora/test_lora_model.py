"""LoRA numerics on CPU: the adapted linear and a whole adapted model against float64 references written
here, the model unchanged at init, merge/unmerge, frozen base without grads or AdamW state, the base with
adapters off as the reference model, and the rollout replica's merged weights against the trained model."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

from model_helpers import make_model, relative_error, small_gpt2, small_llama

from fastlm.engine.config import OptimizerConfig
from fastlm.engine.frozen import copy_frozen, frozen_logits, reference_model
from fastlm.engine.optim import build_optimizer
from fastlm.generation import Generator, SamplingOptions
from fastlm.lora.attach import (
    LoraTargetError,
    attach_lora,
    lora_layers,
    merged_weights,
    select_targets,
)
from fastlm.lora.layer import LoraLinear, Slice
from fastlm.losses.spec import label_logp
from fastlm.models.decoder import build_model
from fastlm.models.lora_config import LoraConfig


def _perturb_adapters(model: torch.nn.Module, seed: int = 7) -> None:
    """B = 0 at init: give every B (and A) random values so the adapters change the output and get gradients."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith("lora_") or ".lora_" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))


def _ids_and_labels(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 12), generator=generator)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[torch.rand(labels.shape, generator=generator) < 0.3] = -100  # masked labels
    return ids, labels


def test_lora_linear_matches_float64_reference() -> None:
    """A fused (q 8 rows, k 4, v 4) linear with bias, adapters on q and v only: output and the gradients of
    x, A and B against y = x W^T + b, y[rows_s] += scale * (x A_s^T) B_s^T in float64."""
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 16, bias=True)
    slices = [Slice("q", 0, 8), Slice("v", 12, 4)]
    layer = LoraLinear(base, slices, rank=3, scale=0.7, dropout=0.0)
    _perturb_adapters(layer)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = torch.randn(2, 5, 12, requires_grad=True)
    upstream = torch.randn(2, 5, 16)
    (layer(x) * upstream).sum().backward()

    x64 = x.detach().double().requires_grad_(True)
    factors = {s.role: (layer.lora_A[s.role].detach().double().requires_grad_(True),
                        layer.lora_B[s.role].detach().double().requires_grad_(True)) for s in slices}
    rows = []
    full = x64 @ base.weight.detach().double().T + base.bias.detach().double()
    for start, size in ((0, 8), (8, 4), (12, 4)):
        block = full[..., start:start + size]
        for s in slices:
            if s.start == start:
                down, up = factors[s.role]
                block = block + 0.7 * (x64 @ down.T) @ up.T
        rows.append(block)
    expected = torch.cat(rows, dim=-1)
    (expected * upstream.double()).sum().backward()
    assert all(p.grad.abs().min() > 0 for p in layer.parameters() if p.requires_grad)
    errors = {"y": relative_error(layer(x).double(), expected), "dx": relative_error(x.grad.double(), x64.grad)}
    for s in slices:
        errors[f"dA_{s.role}"] = relative_error(layer.lora_A[s.role].grad.double(), factors[s.role][0].grad)
        errors[f"dB_{s.role}"] = relative_error(layer.lora_B[s.role].grad.double(), factors[s.role][1].grad)
    print("LoraLinear vs float64:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < 1e-5


@pytest.mark.parametrize("make_config", [small_llama, small_gpt2], ids=["llama", "gpt2"])
def test_model_loss_and_adapter_gradients_match_float64_merged_model(make_config) -> None:
    """Cross-entropy with masked labels through an all-linear fp32 LoRA model vs the float64 model holding
    W + scale B A; the adapters' gradients from the merged weights' gradients: dA_s = scale B_s^T dW_s,
    dB_s = scale dW_s A_s^T."""
    config = make_config()
    model = make_model(config, dtype=torch.float32)
    attach_lora(model, LoraConfig(rank=4, alpha=6.0, targets=["all-linear"]))
    _perturb_adapters(model)
    ids, labels = _ids_and_labels(config.vocab_size, seed=1)
    loss = F.cross_entropy(model.logits(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()

    reference = build_model(config, "cpu").double()
    reference.load_state_dict({name: value.double() for name, value in merged_weights(model)})
    expected = F.cross_entropy(reference.logits(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    expected.backward()
    parameters = dict(reference.named_parameters())
    errors = [abs(loss.item() - expected.item()) / expected.item()]
    for name, layer in lora_layers(model).items():
        grad = parameters[f"{name}.weight"].grad
        for s in layer.slices:
            rows = grad[s.start:s.start + s.size]
            down, up = layer.lora_A[s.role].detach().double(), layer.lora_B[s.role].detach().double()
            errors.append(relative_error(layer.lora_A[s.role].grad.double(), layer.scale * up.T @ rows))
            errors.append(relative_error(layer.lora_B[s.role].grad.double(), layer.scale * rows @ down.T))
    print(f"{config.type}: loss rel err {errors[0]:.1e}, max adapter grad rel err {max(errors[1:]):.1e} "
          f"over {len(errors) - 1} tensors")
    assert max(errors) < 1e-5
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)


def test_at_init_the_model_is_the_base_and_merge_unmerge_is_exact() -> None:
    model = make_model(small_llama(), dtype=torch.float32)
    ids, _ = _ids_and_labels(50, seed=2)
    with torch.no_grad():
        before = model.logits(ids)
        attach_lora(model, LoraConfig(rank=4, targets=["all-linear"], init="gaussian"))
        assert torch.equal(model.logits(ids), before)  # B = 0: the adapters add exact zeros
        _perturb_adapters(model)
        adapted = model.logits(ids)
        weights = {name: layer.weight.detach().clone() for name, layer in lora_layers(model).items()}
        for layer in lora_layers(model).values():
            layer.merge()
        merged = model.logits(ids)
        for layer in lora_layers(model).values():
            layer.unmerge()
        unmerged = model.logits(ids)
    gap = float((merged - adapted).abs().max())
    print(f"merged vs adapter forward: max abs logit gap {gap:.1e}; unmerged: bit-exact")
    assert gap < 1e-5 and not torch.equal(adapted, before)
    assert all(torch.equal(layer.weight, weights[name]) for name, layer in lora_layers(model).items())
    assert torch.equal(unmerged, adapted)


def test_frozen_base_has_no_gradient_and_no_optimizer_state() -> None:
    model = make_model(small_llama(tie_embeddings=False), dtype=torch.float32).train()
    attach_lora(model, LoraConfig(rank=2, targets=["attn.q", "attn.v", "mlp.down"]))
    _perturb_adapters(model)
    optimizer = build_optimizer(model, OptimizerConfig())
    ids, labels = _ids_and_labels(50, seed=3)
    F.cross_entropy(model.logits(ids).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    optimizer.step()
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    frozen = [p for n, p in model.named_parameters() if ".lora_" not in n]
    states = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    print(f"{len(adapters)} adapter tensors ({sum(p.numel() for p in adapters)} values), {len(frozen)} frozen; "
          f"AdamW state tensors {len(states)} holding {sum(t.numel() for t in states)} values")
    assert len(adapters) == 2 * 2 * 3  # (A, B) x (q, v, down) x 2 layers
    assert set(map(id, optimizer.state)) == set(map(id, adapters))
    assert len(states) == 3 * len(adapters)  # step, exp_avg, exp_avg_sq per adapter tensor
    assert all(p.grad is None and not p.requires_grad for p in frozen)


def test_targets_by_fastlm_or_peft_names() -> None:
    llama, gpt2 = build_model(small_llama(), "meta"), build_model(small_gpt2(), "meta")
    def paths(model: torch.nn.Module, patterns: list[str]) -> list[str]:
        return [t.path for t in select_targets(model, patterns)]

    assert paths(llama, ["attn.q", "attn.v"]) == paths(llama, ["q_proj", "v_proj"])
    assert paths(llama, ["mlp.*"]) == paths(llama, ["gate_proj", "up_proj", "down_proj"])
    assert paths(llama, ["blocks.1.attn.o"]) == paths(llama, ["layers.1.self_attn.o_proj"]) == ["blocks.1.attn.o"]
    assert len(paths(llama, ["all-linear"])) == 2 * 7
    assert paths(gpt2, ["c_attn"]) == paths(gpt2, ["attn.q", "attn.k", "attn.v"])
    with pytest.raises(LoraTargetError, match="'attn.qq' matches no linear.*attn.q"):
        select_targets(llama, ["attn.qq"])


@pytest.mark.parametrize("train_head", [False, True])
def test_reference_is_the_base_with_adapters_off(train_head: bool) -> None:
    """DPO's / GRPO's reference of a LoRA model is the same modules with the adapters switched off (the head as
    it was with train_head): its logits equal a separate frozen copy of the base, bit for bit, in train mode
    with dropout too; no second copy of the weights."""
    model = make_model(small_llama(tie_embeddings=False, dropout=0.1), dtype=torch.float32)
    base = copy_frozen(model, torch.device("cpu"))
    attach_lora(model, LoraConfig(rank=4, targets=["all-linear"], dropout=0.2, train_head=train_head))
    _perturb_adapters(model)
    with torch.no_grad():
        model.lm_head_weight.add_(0.5)  # what training the head would do (frozen unless train_head)
    model.train()
    reference = reference_model(model, None, "model.head.losses.dpo.reference_path", torch.device("cpu"))
    assert reference.model is model
    ids, _ = _ids_and_labels(50, seed=4)
    documents = torch.zeros_like(ids)
    ours, theirs = frozen_logits(reference, ids, documents), frozen_logits(base, ids, documents)
    if not train_head:  # the head moved with the "base" here: compare against a copy that has it moved too
        with torch.no_grad():
            base.lm_head_weight.add_(0.5)
        theirs = frozen_logits(base, ids, documents)
    assert torch.equal(ours, theirs) and model.training
    assert torch.equal(label_logp(ours, ids), label_logp(theirs, ids))
    assert all(layer.adapters_enabled for layer in lora_layers(model).values())


def test_rollout_replica_holds_merged_weights() -> None:
    """The generator's replica gets W + scale B A at each sync; its sampled tokens' log-probs equal the
    adapted model's (the trainer's) within the bound the RL runs check for `logp_diff` (1e-4, fp32)."""
    model = make_model(small_llama(), dtype=torch.float32)
    attach_lora(model, LoraConfig(rank=4, targets=["all-linear"]))
    _perturb_adapters(model)
    tokenizer = SimpleNamespace(pad_id=0, eos_id=None, vocab_size=model.config.vocab_size)
    engine = Generator(model, tokenizer, cuda_graph=False)
    engine.sync_weights()
    replica = engine.replica
    assert not lora_layers(replica)
    options = SamplingOptions(max_new_tokens=8, temperature=1.0)
    prompts = [[1, 5, 9], [2, 7, 3, 4]]
    completions = Generator(replica, tokenizer, cuda_graph=False).generate(prompts, options, torch.Generator().manual_seed(0))
    gaps = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model.logits(ids)[0, len(prompt) - 1:-1], dim=-1)
        trained = logp.gather(1, torch.tensor(completion.tokens)[:, None])[:, 0]
        gaps.append(float((trained - torch.tensor(completion.logprobs)).abs().max()))
    with torch.no_grad():  # a second sync after the adapters moved takes the new merge
        for layer in lora_layers(model).values():
            for up in layer.lora_B.values():
                up.mul_(2.0)
        engine.sync_weights()
    merged = dict(merged_weights(model))
    assert all(torch.equal(p, merged[n]) for n, p in engine.replica.named_parameters())
    print(f"replica sampler vs LoRA model log-probs: max gap {max(gaps):.1e}")
    assert max(gaps) < 1e-4


def test_attach_on_meta_allocates_nothing() -> None:
    """Attaching on the meta device (what validate and the checkpoint shape check do) allocates nothing."""
    model = build_model(small_llama(), "meta")
    attach_lora(model, LoraConfig(rank=2))
    assert lora_layers(model) and all(p.is_meta for p in model.parameters())
