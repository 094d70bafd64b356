"""`rl.backend.type: transformers`: rollouts sampled with transformers' `generate` on a Hugging Face-layout
replica of the policy, the parity reference of the native sampler and the template of a server backend.

The replica is the family's HF export built in memory (`config_to_hf` + `to_hf_state`, the same adapter
`fastlm convert --to-hf` uses), in the autocast dtype (fp32 without one); `sync_weights` copies the trainer's
weights (LoRA merged) into it under their HF names. What matches the native sampler (backend.py):

- greedy (temperature 0): the same tokens as the native backend's greedy decode, up to kernel rounding on
  near ties (tests/generation/test_hf_backend.py checks equality on a tiny model, fp32 CPU), and the same
  log-probs: log-softmax of the untempered logits.
- sampling: the distribution is the same one (logits / temperature, then top-k, then top-p keeping the
  smallest set of most likely tokens whose mass reaches top_p: transformers' `TopPLogitsWarper` drops the
  tokens whose ascending cumulative mass is <= 1 - top_p, the native sampler those whose descending mass
  before them is >= top_p: equal in exact arithmetic), and the returned log-prob is each drawn token's
  log-softmax of generate's processed `scores` (after those warpers), so it is the log-prob under the
  distribution it was drawn from, as the native sampler's is. The draws are not the native sampler's: generate
  draws with `torch.multinomial` from the global generator, seeded here from the caller's generator.
- the head's logit transform: the HF architecture applies its own (Gemma 2's final softcap, Granite's logit
  scale); a head that differs is refused by the export (`config_to_hf`). A padded vocab's extra ids are never
  drawn (`suppress_tokens`), as the native sampler leaves them out.
- stop tokens end a completion (the stop token included); the model's own EOS does not unless it is one.

Multi-turn sessions and routing replay are refused by the config (RLConfig).
"""

from __future__ import annotations

from typing import Any

import torch

from fastlm.data.tokenizer import Tokenizer
from fastlm.generation.backend import Weights
from fastlm.generation.generator import Completion, check_prompts
from fastlm.generation.sampling import SEED_LIMIT, SamplingOptions
from fastlm.models.decoder import DecoderLM
from fastlm.models.hf import config_to_hf, to_hf_state


def hf_replica(model: DecoderLM, tokenizer: Tokenizer, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model of `model`'s architecture (weights uninitialised until `load_hf_weights`), on its
    device, in eval mode."""
    import transformers

    hf_config = config_to_hf(model.config, tokenizer, dtype)
    config = transformers.AutoConfig.for_model(**hf_config)
    replica = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return replica.to(model.output_weight.device).requires_grad_(False).eval()


def load_hf_weights(replica: torch.nn.Module, state: dict[str, torch.Tensor], model: DecoderLM) -> None:
    """Copy fastlm-named `state` into the replica under its HF names; every replica tensor must be covered
    (a tied output weight shares the embedding's)."""
    tensors = to_hf_state(state, model.config)
    targets = dict(replica.state_dict())
    missing = [name for name in targets if name not in tensors
               and not (name == "lm_head.weight" and model.config.tie_embeddings)]
    unknown = sorted(set(tensors) - set(targets))
    if missing or unknown:
        raise RuntimeError(f"the HF replica's tensors do not match the export: missing {missing[:3]}, unexpected "
                           f"{unknown[:3]}")
    with torch.no_grad():
        for name, value in tensors.items():
            targets[name].copy_(value)


class TransformersBackend:
    """A `GenerationBackend` on transformers' `generate` (see the module docstring)."""

    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, amp_dtype: torch.dtype | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = next((t for t in (tokenizer.pad_id, tokenizer.eos_id) if t is not None), 0)
        self.vocab = min(model.config.vocab_size, tokenizer.vocab_size)  # the ids the sampler may draw
        self.replica = hf_replica(model, tokenizer, amp_dtype or torch.float32)
        self.version = 0
        self.synced = False

    def sync_weights(self, weights: Weights | None, version: int) -> None:
        """Copy `weights` ((name, tensor) pairs; None: the policy model's, LoRA merged) into the replica."""
        from fastlm.lora.attach import merged_weights

        state = dict(merged_weights(self.model) if weights is None else weights)
        load_hf_weights(self.replica, state, self.model)
        self.version, self.synced = version, True

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], options: SamplingOptions,
                 generator: torch.Generator | None = None) -> list[Completion]:
        """One completion per prompt, left-padded into one `generate` call."""
        import transformers

        if not self.synced:
            raise RuntimeError("TransformersBackend.generate before sync_weights: the replica holds no weights yet")
        check_prompts(prompts, options, self.model)
        device = self.model.output_weight.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        config = transformers.GenerationConfig(
            max_new_tokens=options.max_new_tokens, min_new_tokens=0, do_sample=not options.greedy,
            # every filter explicit when sampling: left unset, generate applies its defaults (top_k 50)
            temperature=None if options.greedy else options.temperature,
            top_k=None if options.greedy else options.top_k, top_p=None if options.greedy else options.top_p,
            eos_token_id=list(options.stop_tokens) or None, pad_token_id=self.pad_id,
            suppress_tokens=list(range(self.vocab, self.model.config.vocab_size)) or None,
            output_scores=True, return_dict_in_generate=True)
        seed = None if generator is None else int(torch.randint(0, SEED_LIMIT, (), generator=generator,
                                                            device=generator.device))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.replica.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                        generation_config=config)
        drawn = out.sequences[:, width:].cpu()
        logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1).cpu()
        picked = logprobs.gather(-1, drawn[..., None]).squeeze(-1)
        return [self._completion(drawn[row].tolist(), picked[row].tolist(), set(options.stop_tokens))
                for row in range(len(prompts))]

    def _completion(self, tokens: list[int], logprobs: list[float], stops: set[int]) -> Completion:
        """Cut a row after its first stop token (generate pads the rows that stopped early)."""
        end = next((i + 1 for i, token in enumerate(tokens) if token in stops), None)
        cut = end or len(tokens)
        return Completion(tokens[:cut], logprobs[:cut], end is not None, policy_version=self.version)

    def session(self, options: SamplingOptions, limit: int) -> Any:
        raise ValueError("rl.backend.type transformers has no multi-turn session; use rl.backend.type native")
