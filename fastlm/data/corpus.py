"""A generated training corpus: small, deterministic from a seed, and learnable by a tiny model.

Templated sentences from a toy grammar plus arithmetic facts ("17+25=42.") give text with strong,
local structure, so loss falls visibly within ~100 CPU steps, with no downloads.
"""

from __future__ import annotations

import random

_SUBJECTS = ("the cat", "the dog", "a bird", "the old man", "my sister", "the farmer", "a child", "the teacher")
_VERBS = ("sees", "likes", "finds", "helps", "follows", "watches", "calls", "paints")
_OBJECTS = ("the river", "a red ball", "the small house", "the moon", "a green tree", "the door", "a book")
_PLACES = ("in the morning", "at night", "near the lake", "after lunch", "in the garden", "every day")


def _sentence(rng: random.Random) -> str:
    """Subject verb object [place]. with a capitalised first letter."""
    words = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.5:
        words += " " + rng.choice(_PLACES)
    return words[0].upper() + words[1:] + "."


def _arithmetic(rng: random.Random) -> str:
    """An addition or subtraction fact with small operands."""
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    if rng.random() < 0.5:
        return f"{a}+{b}={a + b}."
    a, b = max(a, b), min(a, b)
    return f"{a}-{b}={a - b}."


def generate_documents(num_documents: int, seed: int) -> list[str]:
    """`num_documents` documents of 2-5 sentences (a quarter of them arithmetic), identical for equal seeds."""
    if num_documents < 1:
        raise ValueError(f"num_documents must be >= 1, got {num_documents}")
    rng = random.Random(seed)
    documents = []
    for _ in range(num_documents):
        parts = [_arithmetic(rng) if rng.random() < 0.25 else _sentence(rng) for _ in range(rng.randint(2, 5))]
        documents.append(" ".join(parts))
    return documents
