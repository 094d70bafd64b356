"""Multi-turn environments: the calculator's sandbox, tool-call parsing, the chat-template token stream,
continuing generation on the KV cache (float64 log-probs, only new tokens prefilled), episodes with a real
model and a user environment, and a user environment's errors."""

from __future__ import annotations

import copy
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fastlm.config.errors import ConfigError
from fastlm.data.chat import ChatError
from fastlm.data.tokenizer import EOS, ByteTokenizer
from fastlm.generation import Generator, NativeBackend, SamplingOptions
from fastlm.generation.continuation import Continuation
from fastlm.models.config import LlamaConfig
from fastlm.models.decoder import build_model
from fastlm.rl.environments.arithmetic import ToolArithmetic, ToolArithmeticOptions
from fastlm.rl.environments.base import EnvironmentFailure, load_environment
from fastlm.rl.environments.calculator import calculator
from fastlm.rl.environments.config import EnvironmentConfig
from fastlm.rl.environments.episodes import run_episodes
from fastlm.rl.environments.tool_calls import (
    MalformedCall,
    ToolCall,
    format_tool_call,
    parse_tool_calls,
)
from fastlm.rl.environments.transcript import Transcript, demonstration_sample
from fastlm.rl.prompts import PromptRecord
from fastlm.rl.rewards import RewardError

ESCAPES = [
    "__import__('os').system('echo hi')", "().__class__.__mro__[1].__subclasses__()", "(1).__class__.__bases__",
    "abs.__self__", "[c for c in ().__class__.__base__.__subclasses__()]", "9**9**9", "2**10**8", "10**59*10**59",
    "'a'*10**9", "[1]*10**9", "(1,)*10**9", "-" * 300 + "1", "(" * 150 + "1" + ")" * 150, "-" * 60 + "1",
    "+".join(["1"] * 60), "lambda: 0", "open('/etc/passwd')", "globals()", "x", "max(*[1, 2])",
    "round(1, ndigits=2)", "sqrt(-1)", "1/0", "0**-1", "(-8)**0.5", "1e308*10", "True+1", "b'x'", "{1: 2}",
    "1 if 1 else 2", "(y := 3)", "0.5**-2000", "f'{1}'",
]


@pytest.mark.parametrize("expression", ESCAPES)
def test_calculator_refuses_escapes_and_huge_work(expression: str) -> None:
    started = time.perf_counter()
    result = calculator(expression)
    assert result.startswith("error: "), (expression, result)
    assert time.perf_counter() - started < 0.5


HUGE_ARGUMENTS = ["round(7, -10**59)", "round(-7, -(10**59))", "round(10**59, -10**59)", "round(7, -61)",
                  "round(7.5, -10**59)", "round(7, 10**59)", "max(round(1, -10**59), 2)", "sqrt(10**60)",
                  "abs(-10**60)", "min(10**60, -10**60)", "2**-10**59", "(-2)**-10**59", "0.5**10**59",
                  "1.0000001**10**59", "10**59 % 7", "10**59 // 0.5", "-10**60 % 10**60"]


@pytest.mark.parametrize("expression", HUGE_ARGUMENTS)
def test_calculator_bounds_every_functions_arguments(expression: str) -> None:
    """The time budget is checked between nodes only, so an operation must be cheap on any operands the
    bounds let through: `round(7, -10**59)` computed 10**(10**59) and never returned."""
    started = time.perf_counter()
    calculator(expression)
    assert time.perf_counter() - started < 0.5, expression


def test_calculator_computes() -> None:
    cases = {"37*24+19": "907", "7/2": "3.5", "2**0.5": "1.414213562", "-(3-10)%4": "3", "max(3, 8, 5)": "8",
             "round(2.567, 2)": "2.57", "sqrt(16)": "4", "(((1+2)))*3": "9", "2**-2": "0.25", "17//5": "3"}
    for expression, value in cases.items():
        assert calculator(expression) == value, expression


def test_tool_calls_parse_the_qwen_format() -> None:
    text = ("Let me compute. " + format_tool_call("calculator", {"expression": "3*4"})
            + '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
            + "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{\"name\": \"x\"")
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "3*4"}), ToolCall("calculator", {"expression": "1+1"})]
    assert [type(c) for c in calls[2:]] == [MalformedCall, MalformedCall]  # the unclosed last block is no call


MALFORMED_BODIES = {
    "nested 1000 deep": "[" * 1000 + "]" * 1000,
    "nested 100000 deep": '{"name": "calculator", "arguments": ' + "[" * 100000 + "]" * 100000 + "}",
    "an integer of 5000 digits": '{"name": "calculator", "arguments": {"expression": ' + "9" * 5000 + "}}",
    "arguments: a string of 5000 digits": '{"name": "calculator", "arguments": "' + "9" * 5000 + '"}',
    "arguments: a string nested 100000 deep": '{"name": "c", "arguments": "' + "[" * 100000 + '"}',
}


@pytest.mark.parametrize("name", list(MALFORMED_BODIES))
def test_any_tool_call_that_does_not_parse_is_malformed(name: str) -> None:
    """Model output is data: a body that no JSON parser holds (RecursionError, the int digit limit's
    ValueError) is an invalid call that the model reads about, never an exception that stops training."""
    (call,) = parse_tool_calls(f"<tool_call>{MALFORMED_BODIES[name]}</tool_call>")
    assert isinstance(call, MalformedCall) and call.reason.startswith(("the tool call is not valid JSON", "a tool call"))
    environment = ToolArithmetic(ToolArithmeticOptions(), format_reward=0.1)
    messages = environment.reset(PromptRecord("What is 1+1?", {"answer": "Answer: 2"}))
    new, _, info = environment.step(messages, f"<tool_call>{MALFORMED_BODIES[name]}</tool_call>")
    assert new[0]["content"].startswith("error: ") and info["tool_errors"] == 1


def test_tool_call_parsing_is_linear() -> None:
    """20000 unclosed tags took a minute with the lazy regex (each failed start scanned to the end); 5x more
    text must take at most ~10x the time (linear, with slack for a busy machine; quadratic is 25x)."""
    def seconds(count: int) -> float:
        text = ("<tool_call>{}</tool_call>" + "y" * 10) * 10 + "<tool_call>x" * count
        started = time.perf_counter()
        calls = parse_tool_calls(text)
        assert len(calls) == 10 and all(isinstance(c, MalformedCall) for c in calls)
        return time.perf_counter() - started

    small, large = min(seconds(1000) for _ in range(3)), min(seconds(5000) for _ in range(3))
    assert large < 0.5 and large < 10 * small + 0.01, (small, large)
    assert seconds(20000) < 0.5


def test_transcript_renders_tool_turns_through_the_chat_template(tmp_path: Path) -> None:
    """The token stream decodes to the template's rendering: byte chat (EOS ends a turn, not template text)
    and ChatML (`<|im_end|>` is the stop token and the template's text: written once)."""
    from fastlm.data.bpe import train_bpe_tokenizer
    from fastlm.data.config import HuggingFaceTokenizerConfig
    from fastlm.data.hf_tokenizer import HuggingFaceTokenizer

    conversation = [{"role": "user", "content": "What is 3*4?"},
                    {"role": "assistant", "content": format_tool_call("calculator", {"expression": "3*4"})},
                    {"role": "tool", "content": "12"}, {"role": "assistant", "content": "Answer: 12"}]
    byte = ByteTokenizer()
    sample = demonstration_sample(byte, conversation, EOS)
    rendered = byte.render_chat(conversation)
    with_eos = rendered.replace("\n### tool", "<eos>\n### tool")[: -1] + "<eos>"
    assert byte.decode(sample.prompt_tokens + sample.completion_tokens, skip_special=False) == "<bos>" + with_eos
    targets = [t for t, m in zip(sample.completion_tokens, sample.completion_mask) if m]
    assert byte.decode(targets, skip_special=False) == conversation[1]["content"] + "<eos>Answer: 12<eos>"
    folder = train_bpe_tokenizer(["What is 3*4? Answer: 12 calculator expression"] * 20, tmp_path / "bpe", 300, "qwen2")
    chatml = HuggingFaceTokenizer.load(HuggingFaceTokenizerConfig(path=str(folder)))
    stop = chatml.eos_id
    sample = demonstration_sample(chatml, conversation, stop)
    text = chatml.decode(sample.prompt_tokens + sample.completion_tokens, skip_special=False)
    assert text == chatml.render_chat(conversation).removesuffix("\n")
    targets = [t for t, m in zip(sample.completion_tokens, sample.completion_mask) if m]
    assert chatml.decode(targets, skip_special=False) == conversation[1]["content"] + "<|im_end|>Answer: 12<|im_end|>"

    class Reordering(ByteTokenizer):
        def render_chat(self, messages, add_generation_prompt=False):  # drops earlier turns (not incremental)
            return super().render_chat(messages[-1:], add_generation_prompt)

    with pytest.raises(ChatError, match="does not render an assistant turn"):
        Transcript(Reordering(), conversation[:1]).reply("x", EOS, [{"role": "tool", "content": "1"}])


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(LlamaConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=96, init_std=0.3,
                                   vocab_size=260))


def _float64_logprobs(model, sequence: list[int], start: int) -> torch.Tensor:
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        logp = torch.log_softmax(model64.logits(torch.tensor([sequence]))[0], -1)
    return logp[start - 1 : len(sequence) - 1].gather(1, torch.tensor(sequence[start:])[:, None])[:, 0]


def test_continuation_appends_only_new_tokens_and_matches_float64() -> None:
    """Three rows: the first turn, then rows 0 and 2 continue after ragged replies (row 1 is done): each
    continued turn's log-probs are the float64 log-probs of the whole sequence (prompt, turn, reply,
    turn), and the forwards of `extend` see the turn's last token and the reply once, then one token a row."""
    model, tokenizer = _model(), ByteTokenizer()
    engine = Generator(model, tokenizer, padding="right")
    options = SamplingOptions(7, temperature=1.0)
    prompts = [tokenizer.encode("3*4", bos=True), tokenizer.encode("10+20=?", bos=True), tokenizer.encode("7", bos=True)]
    session = Continuation(engine, options, limit=60)
    generator = torch.Generator().manual_seed(0)
    first = session.start(prompts, generator)
    replies = {0: tokenizer.encode("\n### tool\n12\n"), 2: tokenizer.encode("\nok\n")}
    widths: list[tuple[int, int]] = []
    forward = model.cached_hidden_states

    def spy(input_ids, cache, columns, span):
        widths.append(tuple(input_ids.shape))
        return forward(input_ids, cache, columns, span)

    model.cached_hidden_states = spy
    second = session.extend(replies, generator)
    del model.cached_hidden_states
    assert set(second) == {0, 2}
    assert widths[0] == (3, 1 + max(len(r) for r in replies.values())) and all(w == (3, 1) for w in widths[1:])
    for row, reply in replies.items():
        sequence = prompts[row] + first[row].tokens + reply + second[row].tokens
        want = _float64_logprobs(model, sequence, len(sequence) - len(second[row].tokens))
        error = float((torch.tensor(second[row].logprobs).double() - want).abs().max())
        print(f"row {row}: continued turn log-probs vs float64, max abs error {error:.1e}")
        assert error < 1e-5
        assert session.lengths[row] == len(sequence)
    third = session.extend({2: tokenizer.encode("?")}, generator)  # rows finish independently
    sequence = prompts[2] + first[2].tokens + replies[2] + second[2].tokens + tokenizer.encode("?") + third[2].tokens
    want = _float64_logprobs(model, sequence, len(sequence) - len(third[2].tokens))
    assert float((torch.tensor(third[2].logprobs).double() - want).abs().max()) < 1e-5
    room = session.limit - session.lengths[2] - 1  # a reply that leaves one token: the turn is cut there
    (cut,) = session.extend({2: [65] * room}, generator).values()
    assert len(cut.tokens) == 1 and not cut.stopped and session.lengths[2] == session.limit
    with pytest.raises(ValueError, match="do not fit"):
        session.extend({2: [65]}, generator)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graph decode step needs CUDA")
def test_continuation_on_the_cuda_graph_path_matches_float64() -> None:
    """The graph path (replica, captured decode step, FlexAttention decode over per-row columns), fp32:
    a continued turn's sampled log-probs are the float64 ones of the whole sequence (a missing or misplaced
    cache column is off by ~0.5)."""
    model, tokenizer = _model().cuda(), ByteTokenizer()
    engine = Generator(model, tokenizer, cuda_graph=True, padding="right")
    session = Continuation(engine, SamplingOptions(7, temperature=1.0), limit=60)
    generator = torch.Generator(device="cuda").manual_seed(0)
    prompts = [tokenizer.encode("3*4", bos=True), tokenizer.encode("10+20=?", bos=True)]
    first = session.start(prompts, generator)
    second = session.extend({1: tokenizer.encode("\n### tool\n30\n")}, generator)
    sequence = prompts[1] + first[1].tokens + tokenizer.encode("\n### tool\n30\n") + second[1].tokens
    want = _float64_logprobs(model.cpu(), sequence, len(sequence) - len(second[1].tokens))
    assert float((torch.tensor(second[1].logprobs).double() - want).abs().max()) < 5e-3  # TF32 matmuls if enabled


ENVIRONMENT = '''
class Echo:
    """Two turns: the first gets a tool reply; the second ends with the reward len(answer)."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def reset(self, record):
        self.question = record.text
        return [{"role": "user", "content": record.text}]

    def step(self, messages, completion):
        turn = sum(m["role"] == "assistant" for m in messages)
        if self.fail_at == self.question:
            raise ZeroDivisionError("the checker divided by zero")
        if turn == 1:
            return [{"role": "tool", "content": "r" + str(len(completion))}], 0.5, {"tool_calls": 1}
        return None, float(len(completion)), {}


class NoStep:
    def reset(self, record):
        return []
'''


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "my_envs.py").write_text(textwrap.dedent(ENVIRONMENT))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_envs"
    sys.modules.pop("my_envs", None)


def test_user_environment_episodes_on_a_real_model(user_module: str) -> None:
    """Episodes of `my_envs:Echo` with a random tiny model (any ASCII byte stops a turn): the token stream, the policy
    mask, the summed reward, and the sampler's log-probs equal float64 on policy tokens."""
    model, tokenizer = _model(3), ByteTokenizer()
    factory = load_environment(EnvironmentConfig(name=f"{user_module}:Echo", max_turns=3), 0.1)
    backend = NativeBackend(model, tokenizer, padding="right")
    options = SamplingOptions(6, temperature=1.0, stop_tokens=(*range(128), EOS))
    records = [PromptRecord("a"), PromptRecord("bb")]
    episodes, seconds = run_episodes(backend, tokenizer, factory, records, 2, options, torch.Generator().manual_seed(1), 80)
    assert seconds > 0
    assert len(episodes) == 4
    for episode in episodes:
        assert len(episode.tokens) == len(episode.policy) == len(episode.logprobs)
        assert 1 <= episode.turns <= 2
        sequence = episode.prompt + episode.tokens
        want = _float64_logprobs(model, sequence, len(episode.prompt))
        policy = torch.tensor(episode.policy)
        assert float((torch.tensor(episode.logprobs).double() - want)[policy].abs().max()) < 1e-5
        if episode.turns == 2:  # turn one stopped: a tool reply between the turns, masked
            assert not all(episode.policy) and episode.counts["tool_calls"] == 1
            first_turn = episode.policy.index(False)
            reply = tokenizer.decode(episode.tokens[first_turn: first_turn + episode.policy[first_turn:].index(True)])
            assert reply.startswith("\n### tool\nr") and reply.endswith("### assistant\n")
            answer = episode.messages[-1]["content"] if episode.ended else None
            assert not episode.ended or episode.reward == pytest.approx(0.5 + len(answer))
    assert any(e.turns == 2 for e in episodes), "the seed should give a stopped first turn"


def test_user_environment_errors_name_the_class_and_prompt(user_module: str) -> None:
    tokenizer = ByteTokenizer()
    backend = NativeBackend(_model(3), tokenizer, padding="right")
    options = SamplingOptions(6, temperature=1.0, stop_tokens=(*range(128), EOS))
    factory = load_environment(EnvironmentConfig(name=f"{user_module}:Echo", options={"fail_at": "bb"}), 0.1)
    with pytest.raises(EnvironmentFailure, match=r"environment 'my_envs:Echo' step raised ZeroDivisionError: the "
                                                 r"checker divided by zero \(prompt index 1 of this rollout\)"):
        run_episodes(backend, tokenizer, factory, [PromptRecord("a"), PromptRecord("bb")], 2, options,
                     torch.Generator().manual_seed(1), 80)
    assert issubclass(EnvironmentFailure, RewardError)  # the trainer checkpoints and stops on it
    with pytest.raises(ConfigError, match=r"rl.environment.name: 'my_envs:NoStep' has no method\(s\) \['step'\]"):
        load_environment(EnvironmentConfig(name=f"{user_module}:NoStep"), 0.1)
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        load_environment(EnvironmentConfig(name="no_such_module:Env"), 0.1)
    with pytest.raises(ConfigError, match="rl.environment.options"):
        load_environment(EnvironmentConfig(options={"operations": 0}), 0.1)


def test_built_in_environment_scores_and_calls_the_tool() -> None:
    environment = ToolArithmetic(ToolArithmeticOptions(), format_reward=0.1)
    messages = environment.reset(PromptRecord("What is 37*24+19?", {"answer": "Answer: 907"}))
    call = format_tool_call("calculator", {"expression": "37*24+19"})
    new, reward, info = environment.step(messages + [{"role": "assistant", "content": call}], call)
    assert new == [{"role": "tool", "content": "907"}] and reward is None and info == {"tool_calls": 1, "tool_errors": 0}
    bad = format_tool_call("calculator", {"expression": "__import__('os')"}) + format_tool_call("shell", {})
    new, _, info = environment.step(messages, bad)
    assert [m["content"][:6] for m in new] == ["error:", "error:"] and info["tool_errors"] == 2
    assert environment.step(messages, "Answer: 907")[:2] == (None, 1.0)
    assert environment.step(messages, "Answer: 906")[:2] == (None, 0.1)
    assert environment.step(messages, "nine hundred")[:2] == (None, 0.0)
    shown = environment.demonstrations(40, 0.0, seed=0)
    tool = [c for c in shown if len(c) == 4]
    assert 10 < len(tool) < 30 and all(c[2]["content"] == c[3]["content"].removeprefix("Answer: ") for c in tool)
