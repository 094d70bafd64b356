"""One episode's token stream as the model sees it: the prompt, then policy turns and environment replies.

The chat template renders the growing conversation; each rendering must extend the previous one (as in
fastlm/data/chat.py). After a policy turn with text X, ended by its stop token, the tokens appended are
the template's text after X up to the next generation prompt (the new messages, e.g. a "tool" message, and
"assistant" header). The stop token is already in the stream as sampled: when the template writes it as text
right after X (ChatML's `<|im_end|>`), that text is skipped; when it does not (the byte tokenizer's plain
"### role\\ncontent\\n" chat, whose EOS is not template text), the stop token stays as the turn's end marker.
Each appended piece is encoded on its own, exactly as `encode_chat` encodes a conversation's pieces.
"""

from __future__ import annotations

from fastlm.data.chat import ChatError
from fastlm.data.offline_rl import PolicySample
from fastlm.data.tokenizer import Message, Tokenizer
from fastlm.generation import Completion
from fastlm.rl.prompts import encode_prompt


def completion_text(completion: Completion, tokenizer: Tokenizer) -> str:
    """The answer text before the stop token; other special tokens stay visible (so they cost reward)."""
    body = completion.tokens[:-1] if completion.stopped else completion.tokens
    return tokenizer.decode(body, skip_special=False)


class Transcript:
    """The conversation of one episode and the text its tokens so far render."""

    def __init__(self, tokenizer: Tokenizer, messages: list[Message]) -> None:
        self.tokenizer = tokenizer
        self.messages = list(messages)
        self.rendered = tokenizer.render_chat(self.messages, add_generation_prompt=True)
        self.prompt = encode_prompt(tokenizer, self.rendered)

    def reply(self, text: str, stop_token: int, new_messages: list[Message]) -> list[int]:
        """Record the policy's turn `text` (ended by `stop_token`) and `new_messages`; the tokens to append."""
        self.messages.append({"role": "assistant", "content": text})
        self.messages.extend(new_messages)
        full = self.tokenizer.render_chat(self.messages, add_generation_prompt=True)
        before = self.rendered + text
        if not full.startswith(before):
            raise ChatError("the chat template does not render an assistant turn and the messages after it by "
                            "appending to the conversation before them, so the episode cannot continue on its "
                            "cache; use a template that renders turns in order")
        suffix = full[len(before):]
        stop_text = self.tokenizer.decode([stop_token], skip_special=False)
        if stop_text and suffix.startswith(stop_text):
            suffix = suffix[len(stop_text):]
        self.rendered = full
        return self.tokenizer.encode(suffix)

    def record(self, text: str) -> None:
        """The policy's last turn (nothing follows it)."""
        self.messages.append({"role": "assistant", "content": text})


def demonstration_sample(tokenizer: Tokenizer, conversation: list[Message], stop_token: int) -> PolicySample:
    """A solved conversation as the supervised warm-up's sample: the tokens a rollout of it would hold, with
    the assistant turns (each ended by `stop_token`) as targets and everything else masked."""
    first = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), None)
    if first is None:
        raise ChatError("a demonstration needs an assistant message")
    transcript = Transcript(tokenizer, conversation[:first])
    tokens: list[int] = []
    targets: list[bool] = []
    index = first
    while index < len(conversation):
        text = conversation[index]["content"]
        turn = tokenizer.encode(text) + [stop_token]
        tokens += turn
        targets += [True] * len(turn)
        following = first_after = index + 1
        while following < len(conversation) and conversation[following]["role"] != "assistant":
            following += 1
        if following == len(conversation):
            if following != first_after:
                raise ChatError("a demonstration must end with an assistant message")
            break
        appended = transcript.reply(text, stop_token, conversation[first_after:following])
        tokens += appended
        targets += [False] * len(appended)
        index = following
    return PolicySample(transcript.prompt, tokens, 0.0, completion_mask=targets)
