"""`fastlm validate`'s predicted peak training memory: what each memory saver removes, and the refusal of a
step that cannot fit the named device (here `trainer.device: cpu`, this machine's RAM), with the numbers."""

from __future__ import annotations

import torch

from fastlm.commands.main import main
from fastlm.engine.memory import GIB, predict_training_memory
from fastlm.run_config.loader import load_config

LONG = ["data.seq_len=131072", "model.max_seq_len=131072", "data.micro_batch_size=1"]


def predicted(*overrides: str) -> dict[str, int]:
    config = load_config("configs/presets/qwen3-1.7b.yaml", [*LONG, *overrides])
    return predict_training_memory(config, torch.device("cuda")).parts


def test_each_saver_removes_what_it_keeps_off_the_device() -> None:
    plain = predicted()
    checkpointed = predicted("trainer.activation_checkpointing=true")
    offloaded = predicted("trainer.activation_checkpointing=true", "trainer.activation_offload=true")
    tiled = predicted("trainer.activation_checkpointing=true", "trainer.activation_offload=true", "trainer.mlp_tile_len=8192")
    tokens, hidden, layers = 131072, 2048, 28
    print({name: f"{parts['activations'] / GIB:.1f} GiB" for name, parts in
           (("plain", plain), ("ac", checkpointed), ("ac+offload", offloaded), ("ac+offload+tiles", tiled))})
    assert checkpointed["activations"] - offloaded["activations"] == layers * 4 * hidden * tokens
    assert plain["activations"] > checkpointed["activations"] > offloaded["activations"] > tiled["activations"]
    assert plain["weights"] == 4 * 1_720_574_976 and plain["AdamW"] == 8 * 1_720_574_976


def test_the_dense_mask_counts_where_packed_rows_take_it() -> None:
    """Packed rows attend through a (B, 1, S, S) mask on the CPU (and with dropout on CUDA): at 1M tokens that mask
    alone is 1 TiB, which the prediction names; FlexAttention's block mask on CUDA is not counted."""
    config = load_config("configs/tiny.yaml", ["data.seq_len=1048576", "model.max_seq_len=1048576",
                                               "data.micro_batch_size=1"])
    cpu = predict_training_memory(config, torch.device("cpu"))
    assert cpu.parts["attention mask"] == 2**40 and "attention mask 1024.00" in cpu.describe()
    assert predict_training_memory(config, torch.device("cuda")).parts["attention mask"] == 0
    assert cpu.state == cpu.parts["weights"] + cpu.parts["AdamW"] * 3 // 2  # weights + grads + AdamW


def test_validate_prints_the_prediction(capsys) -> None:
    assert main(["validate", "configs/tiny.yaml", "run.name=memory", "data.source.num_documents=20"]) == 0
    assert "predicted peak training memory" in capsys.readouterr().out


def test_long_rl_completions_count_the_rollout_cache() -> None:
    """At 16k-token completions the rollout's KV cache (64 rows x 16k x 28 layers x k and v) outweighs the step."""
    shape = {"vocab_size": 151936, "hidden_size": 2048, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8,
             "intermediate_size": 6144, "max_seq_len": 20000}
    config = load_config("configs/grpo.yaml", [*(f"model.{k}={v}" for k, v in shape.items()), "data.seq_len=16384",
                         "data.micro_batch_size=1", "rl.max_new_tokens=16000", "rl.prompts_per_rollout=8", "rl.group_size=8"])
    parts = predict_training_memory(config, torch.device("cuda")).parts
    print({name: f"{size / GIB:.1f} GiB" for name, size in parts.items()})
    assert parts["KV cache"] == 64 * 16385 * 28 * 2 * 1024 * 2 and "activations" not in parts
