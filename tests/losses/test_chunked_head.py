"""The chunked LM head (losses/chunked_head.py) against float64: every child, both implementations.

Each case projects hidden (T=48, H=8) through weight (V=37 or 38) chunk by chunk and compares the
loss, every child's loss, every metric, and the hidden and weight gradients with float64: the
reference (`reference.reference_loss` on the full float64 logits, autograd) for losses and gradients,
the compiled path on the full float64 logits for metrics. Chunks of 12 tokens (dividing T) for the
compiled path and of 10 (5 chunks, the last of 8: not dividing T) for Triton with vocab blocks of 16
(rows loop over 3 blocks, the last partial; the tensor-parallel test has one block a row); inputs from loss_cases.make_case
(~30% masked labels whose policy inputs are NaN, several documents per row, documents crossing chunk boundaries). Distillation
takes the teacher's hidden states and head weight with its own logit transform (one case the full
teacher logits). Backward runs on `0.75 * loss` with grad_scale 2, so both scalings reach dH and dW.

Without CUDA, Triton runs on its interpreter (tests/conftest.py); on CUDA the same cases run compiled,
plus `test_bf16_autocast_on_cuda` (bf16 GEMMs under autocast, the trainer's setting; tolerances in it).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from loss_cases import make_case, make_spec, reference_with_grad, rel_err, seed_of
from torch.utils._python_dispatch import TorchDispatchMode

from fastlm.layers.lm_head import LMHead
from fastlm.losses.chunked_head import TEACHER_PIECES, Chunking, chunked_head_loss, chunking
from fastlm.losses.compiled import compiled_loss
from fastlm.losses.config import LMHeadConfig
from fastlm.losses.spec import LossNormalizers, LossResult, LossSpec, LossTargets, TeacherHead, label_logp
from fastlm.losses.validation import collected_value_checks
from tests.distributed.dist_helpers import spawn_ranks

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOKENS, HIDDEN, TEACHER_HIDDEN = 48, 8, 6
FP32_TOL = 2e-5
# name: (kinds, child options, child weights, head numbers); every child and the policy options
CASES = {
    "ce+z": ("ce+z", {}, {}, {}),
    "ce+z+grpo softcap": ("ce+z+grpo", {}, {"ce": 0.5}, {"logit_scale": 1.3, "softcap": 4.0}),
    "grpo seq-mean dual-clip+ce": ("ce+grpo", {"grpo": {"loss_type": "grpo", "delta": 1.4}}, {}, {}),
    "cispo bnpo beta entropy": ("cispo", {"cispo": {"loss_type": "bnpo", "beta": 0.1, "entropy_coeff": 0.05}}, {}, {}),
    "grpo w0 entropy beta dr_grpo+ce": ("ce+grpo", {"grpo": {"entropy_coeff": 0.05, "beta": 0.1, "loss_type": "dr_grpo",
                                                             "max_completion_length": 12}}, {"grpo": 0.0}, {}),
    # the token-mean entropy bonus of dapo: the call's mean (a weight row of the fused kernel), not the chunk's
    "grpo dapo entropy beta+ce": ("ce+grpo", {"grpo": {"entropy_coeff": 0.05, "beta": 0.1}}, {}, {}),
    "gspo dapo delta entropy beta+z": ("gspo+z", {"gspo": {"loss_type": "dapo", "delta": 1.2, "entropy_coeff": 0.05,
                                                          "beta": 0.1}}, {}, {"softcap": 3.0}),
    "ce+grpo seq-mean+gspo": ("ce+grpo+gspo", {"grpo": {"loss_type": "grpo"}, "gspo": {"eps_low": 0.2, "eps_high": 0.3}},
                              {}, {}),
    "ce+kd": ("ce+kd", {}, {}, {"softcap": 3.0, "logit_scale": 1.3}),
    "kd_rev+z w0": ("kd_rev+z", {}, {"z": 0.0}, {}),
    "gspo dr_grpo+kd_rev": ("gspo+kd_rev", {"gspo": {"loss_type": "dr_grpo", "max_completion_length": 12}}, {}, {}),
    "ce+kd_both": ("ce+kd_both", {}, {}, {}),
    # a call-wide entropy quantile: the two passes (the middle on the whole call), the torch tail
    "grpo top-entropy bias-kl+ce": ("ce+grpo", {"grpo": {"top_entropy_quantile": 0.5, "beta": 0.1,
                                                         "bias_corrected_kl": True, "entropy_coeff": 0.05}}, {}, {}),
    "gspo top-entropy bias-kl": ("gspo", {"gspo": {"top_entropy_quantile": 0.6, "beta": 0.1, "bias_corrected_kl": True}},
                                 {}, {}),
}
# (implementation, rows of the budget, options): chunks of 12 (4 of them) and, from a budget of 11 rows,
# evened out to 10 (10, 10, 10, 10, 8: not dividing T)
RUNS = {"compiled": ("compiled", 12, {}), "triton looped": ("triton", 11, {"max_block": 16})}
TEACHER_TRANSFORM = {"logit_scale": 1.25, "softcap": 6.0}


@dataclasses.dataclass
class HeadCase:
    spec: LossSpec
    hidden: torch.Tensor  # float64
    weight: torch.Tensor
    targets: LossTargets  # with teacher_head (and teacher_logits for the reference), float32 policy inputs
    normalizers: LossNormalizers


def head_case(name: str, vocab: int = 37, spec: LossSpec | None = None) -> HeadCase:
    """CASES[name] (or `spec`): float64 hidden, weight and teacher head input; make_case's targets."""
    if spec is None:
        kinds, options, weights, numbers = CASES[name]
        spec = make_spec(kinds, weights, options, **numbers)
    generator = torch.Generator().manual_seed(seed_of("chunked" + name))
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, HIDDEN, generator=generator, dtype=torch.float64) * 0.6
    teacher_hidden = torch.randn(TOKENS, TEACHER_HIDDEN, generator=generator, dtype=torch.float64)
    teacher_weight = torch.randn(vocab, TEACHER_HIDDEN, generator=generator, dtype=torch.float64) * 0.8
    # make_case's per-token targets, its policy inputs drawn near the softmax of these logits
    logits = hidden @ weight.t()
    _, targets, normalizers = make_case(seed_of("chunked-targets" + name), tokens=TOKENS, vocab=vocab, spec=spec)
    mask = targets.labels != -100
    new_logp = label_logp(logits, targets.labels, spec.logit_scale, spec.softcap)
    shift = torch.randn(TOKENS, generator=generator, dtype=torch.float64) * 0.3
    targets.old_logp = torch.where(mask, new_logp + shift, torch.nan).float()
    targets.ref_logp = torch.where(mask, new_logp - shift, torch.nan).float()
    teacher = TeacherHead(teacher_hidden, teacher_weight, **TEACHER_TRANSFORM)
    targets = dataclasses.replace(targets, teacher_head=teacher, teacher_logits=teacher.logits())
    return HeadCase(spec, hidden, weight, targets, normalizers)


def rows_budget(rows: int, vocab: int, dtype: torch.dtype, teacher: bool) -> float:
    """The logits_memory_mib that makes `rows`-token chunks (with a teacher head, its logits about a
    quarter of that at a time: the rest of the budget)."""
    limit = -(-rows * (TEACHER_PIECES + 1) // TEACHER_PIECES) if teacher else rows
    budget = (limit * vocab * dtype.itemsize + 0.5) / 2**20
    plan = chunking(10**6, vocab, dtype.itemsize, budget, teacher)
    assert plan == Chunking(rows, max(1, limit - rows) if teacher else 0), plan
    return budget


def expected(
    case: HeadCase, grad_scale: float = 1.5, rounded: torch.dtype | None = None
) -> tuple[LossResult, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """float64: result, d(grad_scale loss)/d hidden and / d weight by autograd; the compiled path's metrics.
    `rounded` (bf16): hidden, weight and their product rounded to it first, so the float64 reference sees
    the logits a bf16 GEMM hands the loss (a ratio on a clip boundary then falls on the same side)."""
    hidden, weight = case.hidden, case.weight
    if rounded is not None:
        hidden, weight = hidden.to(rounded).double(), weight.to(rounded).double()
    logits = hidden @ weight.t()
    if rounded is not None:
        logits = logits.to(rounded).double()
    result, grad_logits = reference_with_grad(logits, case.targets, case.normalizers, case.spec, grad_scale=grad_scale)
    targets64 = LossTargets(*(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                              for t in dataclasses.astuple(dataclasses.replace(case.targets, teacher_head=None))))
    metrics = compiled_loss(logits, targets64, case.normalizers, case.spec)[0].metrics
    return result, grad_logits @ weight, grad_logits.t() @ hidden, metrics


def on_device(targets: LossTargets, device: torch.device, full_teacher: bool) -> LossTargets:
    """float32 targets on `device`, the teacher as its head input (or its full float32 logits)."""
    skipped = () if full_teacher else ("teacher_logits",)  # never copied: a full-logits tensor on the device
    moved = {field.name: getattr(targets, field.name).to(device) for field in dataclasses.fields(targets)
             if isinstance(getattr(targets, field.name), torch.Tensor) and field.name not in skipped}
    teacher = targets.teacher_head
    if full_teacher:
        moved.update(teacher_logits=moved["teacher_logits"].float(), teacher_head=None)
    else:
        moved.update(
            teacher_logits=None,
            teacher_head=dataclasses.replace(
                teacher, hidden=teacher.hidden.to(device, torch.float32), weight=teacher.weight.to(device, torch.float32)
            ),
        )
    return dataclasses.replace(targets, **moved)


def run_head(case: HeadCase, implementation: str, rows: int, options: dict, dtype: torch.dtype = torch.float32,
             full_teacher: bool = False, budget: float | None = None,
             **kwargs: object) -> tuple[LossResult, torch.Tensor, torch.Tensor]:
    """The chunked head on `case`, in chunks of `rows` tokens (or from `budget` MiB); backward on 0.75 x loss."""
    hidden = case.hidden.to(DEVICE, dtype).requires_grad_(True)
    weight = case.weight.to(DEVICE, dtype).requires_grad_(True)
    teacher = case.spec.teacher is not None and not full_teacher
    budget = rows_budget(rows, case.weight.shape[0], dtype, teacher) if budget is None else budget
    result = chunked_head_loss(hidden, weight, on_device(case.targets, DEVICE, full_teacher), case.normalizers,
                               case.spec, implementation, budget, grad_scale=2.0, options=options, **kwargs)
    (result.loss * 0.75).backward()
    return result, hidden.grad, weight.grad


def errors_of(
    result: LossResult, grad_hidden: torch.Tensor, grad_weight: torch.Tensor, case: HeadCase,
    rounded: torch.dtype | None = None,
) -> dict[str, float]:
    reference, hidden64, weight64, metrics64 = expected(case, rounded=rounded)
    errors = {child: rel_err(value.cpu(), reference.losses[child]) for child, value in result.losses.items()}
    errors["total"] = rel_err(result.loss.cpu(), reference.loss)
    errors["hidden"] = rel_err(grad_hidden.cpu(), hidden64)
    errors["weight"] = rel_err(grad_weight.cpu(), weight64)
    errors.update({key: rel_err(value.cpu(), metrics64[key]) for key, value in result.metrics.items()})
    assert set(result.losses) == set(reference.losses) and set(result.metrics) == set(metrics64)
    assert torch.isfinite(grad_hidden).all() and torch.isfinite(grad_weight).all()
    return errors


@pytest.mark.parametrize(("name", "run"), [(name, run) for name in CASES for run in RUNS])
def test_chunked_head_matches_float64(name: str, run: str) -> None:
    implementation, rows, options = RUNS[run]
    case = head_case(name)
    errors = errors_of(*run_head(case, implementation, rows, options), case)
    teacher = case.spec.teacher is not None
    plan = chunking(TOKENS, case.weight.shape[0], 4, rows_budget(rows, case.weight.shape[0], torch.float32, teacher), teacher)
    print(f"{name} / {run}, chunks of {plan.tokens} (teacher logits {plan.teacher_tokens} at a time): "
          + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < FP32_TOL, errors


def test_full_teacher_logits_are_sliced() -> None:
    """A caller with the teacher's full logits (not its head input) gets the same chunked result."""
    case = head_case("ce+kd")
    errors = errors_of(*run_head(case, "compiled", 11, {}, full_teacher=True), case)
    print("ce+kd, full teacher logits, compiled: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < FP32_TOL


GEMMS = ("mm", "addmm", "addmm_")


def test_bad_input_names_whole_call_tokens() -> None:
    """A bad label in the fourth chunk is named by its index in the call; a teacher of another vocab by its shape."""
    case = head_case("ce+kd")
    labels = case.targets.labels.clone()
    labels[40] = 99
    bad = dataclasses.replace(case, targets=dataclasses.replace(case.targets, labels=labels))
    with pytest.raises(ValueError, match=r"targets.labels\[40\] = 99 is outside the vocabulary \[0, 37\)"):
        run_head(bad, "compiled", 12, {})
    teacher = dataclasses.replace(case.targets.teacher_head, weight=case.targets.teacher_head.weight[:30])
    other = dataclasses.replace(case, targets=dataclasses.replace(case.targets, teacher_head=teacher))
    with pytest.raises(
        ValueError, match=r"targets.teacher_head.weight must be \(vocab=37, teacher hidden size=6\), got \(30, 6\)"
    ):
        run_head(other, "compiled", 12, {})


def test_one_value_check_per_call() -> None:
    """Collected (as the trainer does), a call of 4 chunks gives one check: the whole call's counts, made
    before its chunks; the chunks count the same values on their rows and those are not collected."""
    case = head_case("ce+z+grpo softcap")
    with collected_value_checks() as checks:
        run_head(case, "compiled", 12, {})
    labels = case.targets.labels
    assert len(checks) == 1
    assert checks[0].counts.tolist() == [0, int((labels != -100).sum()), 0, 0]
    assert checks[0].labels.shape == labels.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to be busy after the call; runs on the H200")
def test_call_returns_while_its_chunks_run() -> None:
    """The call's one host read waits for its value-check counts (copied to the host before the chunks),
    not for the chunks' GEMMs: the forward returns with the GPU still at work. Reading at the end, as
    before session 10, drained it, and the GPU idled while the host queued the next call."""
    tokens, hidden_size, vocab = 16384, 2048, 32768
    spec = make_spec("ce+z")
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=generator, dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=generator, dtype=torch.bfloat16) * hidden_size**-0.5
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=generator)
    targets, normalizers = LossTargets(labels), LossNormalizers(float(tokens))
    budget = rows_budget(2048, vocab, torch.bfloat16, False)  # 8 chunks: ~10 ms of GEMMs on an H100
    for _ in range(2):  # the first compiles the kernels
        torch.cuda.synchronize()
        result = chunked_head_loss(hidden, weight, targets, normalizers, spec, "triton", budget)
        busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "the chunked head's forward waited for its chunks to finish"
    assert torch.isfinite(result.loss)


def test_teacher_logits_come_a_piece_of_the_chunk_at_a_time() -> None:
    """With a teacher head the call runs whole when both its logits fit; else the student's chunk from
    4/5 of the budget (its dH and dW GEMMs on twice the rows of two equal buffers) and the teacher's
    logits the rest at a time, in multiples of 128 tokens; student + teacher stay in the budget."""
    assert chunking(16384, 131072, 2, 1408, teacher=True) == Chunking(4096, 1536)  # 5632 rows fit, not 2 x 2048
    assert chunking(16384, 131072, 2, 1536, teacher=True) == Chunking(4096, 2048)  # 6144 rows
    assert chunking(2816, 131072, 2, 1408, teacher=True) == Chunking(2816, 2816)  # both fit: one chunk, one piece
    assert chunking(3000, 131072, 2, 1408, teacher=True) == Chunking(3000, 2632 - 2632 % 128)
    assert chunking(48, 37, 4, 0.001, teacher=True) == Chunking(5, 2)  # 7 rows fit: 5 + 2
    for budget in (0.001, 0.01, 0.5, 3.0, 100.0, 700.0, 1408.0, 5000.0):
        for tokens in (1, 47, 1000, 5000, 65536):
            plan = chunking(tokens, 131072, 2, budget, teacher=True)
            rows = max(1, int(budget * 2**20) // (131072 * 2))
            assert 1 <= plan.teacher_tokens <= plan.tokens <= max(tokens, 1), (budget, tokens, plan)
            assert plan.tokens + plan.teacher_tokens <= max(rows, 2), (budget, tokens, plan)


def test_second_backward_says_how_to_get_one() -> None:
    """The gradients are handed over once (no copy kept); retain_graph users are told to use full logits."""
    case = head_case("ce+z")
    hidden, weight = case.hidden.float().requires_grad_(True), case.weight.float().requires_grad_(True)
    result = chunked_head_loss(hidden, weight, on_device(case.targets, torch.device("cpu"), False), case.normalizers,
                               case.spec, "compiled", 0.001)
    result.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="logits_memory_mib: 0"):
        result.loss.backward()


class _Recorder(TorchDispatchMode):
    """Every op's name and its outputs' shapes (meta tensors, which allocate nothing, left out: the
    head's whole-call checks run on a shape-only stand-in of the logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        self.calls.append((str(func.overloadpacket.__name__), shapes))
        return out


@pytest.mark.parametrize("name", ["ce+kd", "gspo dapo delta entropy beta+z", "gspo dr_grpo+kd_rev"])
def test_full_logits_never_exist(name: str) -> None:
    """No op of forward + backward makes a tensor of more than one chunk of logits (T=48, chunks of 12,
    vocab 37); the logits GEMMs write a (12, 37) buffer: 3 GEMMs a chunk, 4 with a per-document child;
    a teacher's logits come 3 rows at a time (4 GEMMs a chunk, in each pass)."""
    case = head_case(name)
    with _Recorder() as recorder:
        run_head(case, "compiled", 12, {})
    vocab, chunks = case.weight.shape[0], TOKENS // 12
    biggest = max(torch.Size(shape).numel() for _, shapes in recorder.calls for shape in shapes)
    gemms = [(op, shapes) for op, shapes in recorder.calls if op in GEMMS]
    logits_gemms = [shapes for op, shapes in gemms if shapes == [(12, vocab)]]
    teacher_gemms = [shapes for op, shapes in gemms if shapes == [(3, vocab)]]
    per_chunk = 4 if case.spec.per_document else 3
    teacher = 12 // 3 * (2 if case.spec.per_document else 1) if case.spec.teacher is not None else 0
    print(f"{name}: largest tensor {biggest} elements (full logits {TOKENS * vocab}), {len(gemms)} GEMMs")
    assert biggest <= 12 * vocab < TOKENS * vocab
    assert len(gemms) == chunks * (per_chunk + teacher)
    assert len(logits_gemms) == chunks * (per_chunk - 2) and len(teacher_gemms) == chunks * teacher


@pytest.mark.parametrize("name", ["gspo dapo delta entropy beta+z", "gspo dr_grpo+kd_rev"])
def test_one_chunk_with_a_per_document_child_keeps_its_logits(name: str) -> None:
    """Two passes over a single chunk reuse the logits still in the buffer (the teacher's too, when the
    call's two logits fit the budget): 3 GEMMs (+ 1 for the teacher), as the one-pass head."""
    case = head_case(name)
    teacher = case.spec.teacher is not None
    budget = 2 * TOKENS * case.weight.shape[0] * 4 / 2**20
    with _Recorder() as recorder:
        result, grad_hidden, grad_weight = run_head(case, "compiled", TOKENS, {}, budget=budget)
    assert sum(op in GEMMS for op, _ in recorder.calls) == 3 + teacher
    assert max(errors_of(result, grad_hidden, grad_weight, case).values()) < FP32_TOL


BF16_TOL = 2e-2  # bf16 logits and logit gradients (8 mantissa bits), every GEMM output rounded to bf16


@pytest.mark.parametrize("fp32_weight_grad", [False, True], ids=["bf16-sum", "fp32-sum"])
def test_bf16_weight_gradient_accumulation(fp32_weight_grad: bool) -> None:
    """bf16 hidden and weight (no autocast): dW summed over 5 chunks in bf16 (the weight's dtype) or in
    fp32, both within bf16 rounding of float64 (the benchmark states both at scale)."""
    case = head_case("ce+z")
    result, grad_hidden, grad_weight = run_head(case, "compiled", 11, {}, dtype=torch.bfloat16,
                                                fp32_weight_grad=fp32_weight_grad)
    assert grad_hidden.dtype == grad_weight.dtype == torch.bfloat16
    errors = errors_of(result, grad_hidden.float(), grad_weight.float(), case, rounded=torch.bfloat16)
    print(f"bf16, dW {'fp32' if fp32_weight_grad else 'bf16'} sum: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < BF16_TOL


@pytest.mark.parametrize("name", ["ce+z+grpo softcap", "gspo dr_grpo+kd_rev"])
def test_autocast_grads_keep_the_input_dtypes(name: str) -> None:
    """Under bf16 autocast (the trainer's setting) with fp32 hidden and weight: bf16 GEMMs (the teacher's
    too), fp32 gradients, within bf16 rounding of float64 (on the same bf16 logits)."""
    case = head_case(name)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        result, grad_hidden, grad_weight = run_head(case, "compiled", 11, {})
    assert grad_hidden.dtype == grad_weight.dtype == torch.float32
    errors = errors_of(result, grad_hidden, grad_weight, case, rounded=torch.bfloat16)
    print(f"{name} / autocast bf16: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < BF16_TOL, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton GEMM path on CUDA; runs on the H200 (tools/gpu/head.sh)")
@pytest.mark.parametrize("name", ["ce+z+grpo softcap", "cispo bnpo beta entropy", "gspo dapo delta entropy beta+z", "ce+kd"])
def test_bf16_autocast_on_cuda(name: str) -> None:
    """The trainer's setting on CUDA: fp32 hidden and weight, bf16 autocast, the fused Triton kernel
    compiled (one-pass, two-pass and teacher cases: each kernel variant is a compile), chunks of 12;
    against float64 on the same bf16 logits, BF16_TOL."""
    case = head_case(name)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        errors = errors_of(*run_head(case, "triton", 12, {}), case, rounded=torch.bfloat16)
    print(f"{name} / bf16 autocast triton: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < BF16_TOL, errors


def test_lm_head_config_picks_the_chunked_head() -> None:
    """logits_memory_mib: null (1408) and a number run chunked, 0 the full-logits head; the dry run says so."""
    default = LMHead(LMHeadConfig())
    full = LMHead(LMHeadConfig(logits_memory_mib=0))
    assert default.chunked and default.logits_memory_mib == 1408 and not full.chunked
    assert "chunked, no full logits (logits_memory_mib 1408): 4096 of 16384 tokens a chunk (4 chunks)" in default.describe(
        16384, 131072, torch.bfloat16)
    assert "head: full logits" in full.describe(16384, 131072, torch.bfloat16)
    distill = LMHead(LMHeadConfig.model_validate({"losses": {"ce": {"type": "cross_entropy"}, "kd": {"type": "distillation"}}}))
    assert ("4096 of 16384 tokens a chunk (4 chunks, the teacher's logits 1536 at a time) at vocab 131072 in bfloat16"
            in distill.describe(16384, 131072, torch.bfloat16))
    assert "2048 of 2048 tokens a chunk (1 chunk) at vocab 131072" in distill.describe(2048, 131072, torch.bfloat16)
    assert chunking(16484, 131072, 2, 1408) == Chunking(4096)  # 1024 x a power of two from 1024 rows up (5632 fit)
    assert chunking(16384, 32000, 2, 1408) == Chunking(16384)  # all tokens fit: one chunk
    assert chunking(1100, 131072, 2, 128) == Chunking(384)  # 512 rows fit: 3 even chunks, multiples of 128
    assert chunking(5, 131072, 2, 0.001) == Chunking(1)  # at least one row
    case = head_case("ce+z")
    hidden, weight = case.hidden.float().requires_grad_(True), case.weight.float().requires_grad_(True)
    targets = on_device(case.targets, torch.device("cpu"), False)
    results = [head(hidden, weight, targets, case.normalizers).loss for head in (default, full)]
    assert rel_err(results[0], results[1]) < 1e-6


# Vocab-parallel heads (as configs: the head goes through `vocab_parallel_loss`, as in the model).
TP_HEADS = {
    "ce+z+grpo seq-mean softcap": {"losses": {"ce": {"type": "cross_entropy"}, "z": {"type": "z_loss", "weight": 0.1},
                                              "grpo": {"type": "grpo", "loss_type": "grpo", "eps_high": 0.25}},
                                   "softcap": 4.0},
    "gspo entropy beta+z+kd_rev": {"losses": {"gspo": {"type": "gspo", "loss_type": "dapo", "eps_low": 0.05, "eps_high": 0.08,
                                                       "entropy_coeff": 0.05, "beta": 0.1},
                                              "z": {"type": "z_loss", "weight": 0.1},
                                              "kd": {"type": "distillation", "kl": "reverse", "temperature": 1.7}}},
}
TP_ROWS = {"compiled": 11, "triton": 12}  # chunks of 10 (not dividing 48) and 12; Triton: 19 ids a rank, one block


def _tp_rank(rank: int, world: int, folder: str) -> None:
    """One rank: hidden (copy_to_tp sums its gradient over the group), this rank's 19 rows of the
    weight, the teacher's full head weight (vocab_parallel_loss cuts its rows); both implementations."""
    from fastlm.layers.vocab_parallel import vocab_parallel_loss

    saved = {}
    for name, config in TP_HEADS.items():
        for implementation, rows in TP_ROWS.items():
            budget = rows_budget(rows, 19, torch.float32, True)
            head = LMHead(LMHeadConfig.model_validate({**config, "use_triton": implementation == "triton",
                                                       "logits_memory_mib": budget}), DEVICE)
            case = head_case(name, vocab=38, spec=head.spec)
            hidden = case.hidden.to(DEVICE, torch.float32).requires_grad_(True)
            weight = case.weight[rank * 19 : (rank + 1) * 19].to(DEVICE, torch.float32).requires_grad_(True)
            targets = on_device(case.targets, DEVICE, False)
            result = vocab_parallel_loss(head, hidden, weight, targets, case.normalizers, dist.group.WORLD)
            result.loss.backward()
            saved[name, implementation] = (result.loss.cpu(), {k: v.cpu() for k, v in result.losses.items()},
                                           {k: v.cpu() for k, v in result.metrics.items()}, hidden.grad.cpu(),
                                           weight.grad.cpu())
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))


def test_tensor_parallel_two_ranks(tmp_path: os.PathLike) -> None:
    """gloo, world size 2: every rank's losses, metrics and summed hidden gradient are the float64
    reference's on the full vocab; each rank's weight gradient is its rows of the reference's."""
    world = 2
    spawn_ranks(_tp_rank, str(tmp_path), world=world)
    ranks = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(world)]
    for name, config in TP_HEADS.items():
        spec = LMHead(LMHeadConfig.model_validate(config)).spec
        case = head_case(name, vocab=38, spec=spec)
        reference, hidden64, weight64, metrics64 = expected(case, grad_scale=1.0)
        for implementation in TP_ROWS:
            for rank, saved in enumerate(ranks):
                loss, losses, metrics, grad_hidden, grad_weight = saved[name, implementation]
                errors = {child: rel_err(value, reference.losses[child]) for child, value in losses.items()}
                errors["total"] = rel_err(loss, reference.loss)
                errors["hidden"] = rel_err(grad_hidden, hidden64)
                errors["weight"] = rel_err(grad_weight, weight64[rank * 19 : (rank + 1) * 19])
                errors.update({key: rel_err(value, metrics64[key]) for key, value in metrics.items()})
                print(f"TP {name} / {implementation} rank {rank}: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
                assert set(metrics) == set(metrics64) and max(errors.values()) < FP32_TOL, errors
