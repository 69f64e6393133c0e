"""Chat sessions for `bench prefix-routing`: users of one chat product (one system prompt for
all) who each hold a conversation of a few turns, every turn resending the history with the
model's real answers in it. Text, not token ids: the gateway's prefix scorer hashes characters.

Pure: the text comes from a seeded generator of pronounceable words.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")


def words(rng: random.Random, count: int) -> str:
    """`count` words of one to three syllables, spaced, ending in a full stop."""
    out = []
    for _ in range(count):
        syllables = rng.randint(1, 3)
        out.append("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)))
    return " ".join(out) + "."


@dataclass(frozen=True)
class ChatWorkload:
    sessions: int = 8
    """Conversations held at once (closed loop: each waits for its answer)."""
    turns: int = 4
    """User messages per conversation."""
    system_words: int = 120
    """The system prompt every conversation starts with."""
    question_words: int = 24
    """Each user message."""
    answer_tokens: int = 32
    """Each answer (max_tokens, EOS ignored)."""
    think_s: float = 1.0
    """Mean pause between an answer and the user's next message (exponential)."""

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "system_words", "question_words", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.think_s < 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s}")


@dataclass
class ChatSession:
    """One conversation: the messages so far; `next_messages` asks the next turn."""

    system_prompt: str
    rng: random.Random
    question_words: int
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system_prompt}]

    def next_messages(self) -> list[dict[str, str]]:
        """The history and a new user message, which stays in the history."""
        self.messages.append({"role": "user", "content": words(self.rng, self.question_words)})
        return list(self.messages)

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def chat_sessions(workload: ChatWorkload, seed: int) -> list[ChatSession]:
    """The sessions of one run: one system prompt drawn from `seed`, each session's questions
    from a generator of its own. Different seeds share no text, so one run's prompts find
    nothing another run left in the caches."""
    system_prompt = f"[{seed}] " + words(random.Random(seed), workload.system_words)
    return [
        ChatSession(system_prompt, random.Random(f"{seed}/{i}"), workload.question_words)
        for i in range(workload.sessions)
    ]
