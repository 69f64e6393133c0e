"""OpenAI's `logprobs` objects from the engine's per-token log-probabilities.

Completions use the legacy columns (`tokens`, `token_logprobs`, `top_logprobs` as
{token: logprob} maps, `text_offset`); chat uses `content`, one entry per token with its
`bytes` and `top_logprobs` list. A token's text is its id decoded alone (special tokens kept), as
vLLM shows it; a token holding part of a multi-byte character shows U+FFFD there, and its bytes
are those of that text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from controller.logprobs import TokenLogprobs
from controller.openai_api.responses import Kind
from controller.tokenizer import Tokenizer


class LogprobsFormatter:
    """One response's logprobs; completions' text offsets run on across a choice's chunks,
    each choice's from 0."""

    def __init__(self, tokenizer: Tokenizer, kind: Kind) -> None:
        self.tokenizer = tokenizer
        self.kind = kind
        self.text_offsets: dict[int, int] = {}
        """Each choice's next text offset, by choice index."""

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def format(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs], choice: int = 0
    ) -> dict[str, object]:
        """The logprobs object of these tokens of a choice (one entry each, in order)."""
        if self.kind == "chat":
            pairs = zip(token_ids, entries, strict=True)
            return {"content": [self._chat_entry(t, e) for t, e in pairs]}
        return dict(self._columns(token_ids, entries, choice))

    def format_prompt(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs], choice: int = 0
    ) -> dict[str, object]:
        """Completions' echo: the prompt's columns, its first token without a log-probability
        (nothing comes before it), as OpenAI and vLLM show it."""
        scored: list[TokenLogprobs | None] = [None, *entries] if token_ids else []
        return dict(self._columns(token_ids, scored, choice))

    def _columns(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], choice: int
    ) -> dict[str, list[Any]]:
        """Completions' legacy columns; the choice's text offsets run on from its last call."""
        texts = [self._text(t) for t in token_ids]
        offsets = []
        offset = self.text_offsets.get(choice, 0)
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        self.text_offsets[choice] = offset
        return {
            "tokens": texts,
            "token_logprobs": [e.logprob if e else None for e in entries],
            "top_logprobs": [
                {self._text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)}
                if e
                else None
                for e in entries
            ],
            "text_offset": offsets,
        }

    @staticmethod
    def join(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, object]:
        """Two legacy logprobs objects as one (the echoed prompt, then the completion)."""
        return {key: [*first[key], *second[key]] for key in first}

    def _chat_entry(self, token_id: int, entry: TokenLogprobs) -> dict[str, object]:
        text = self._text(token_id)
        return {
            "token": text,
            "logprob": entry.logprob,
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (alt := self._text(t)), "logprob": lp, "bytes": list(alt.encode())}
                for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
            ],
        }
