"""The controller's tokenizer: a model folder's `tokenizer.json` through the `tokenizers` library.

It encodes prompts (optionally through the model's chat template, rendered with jinja2 the way
transformers renders it), names the ids that end generation, and turns each sequence's output
ids into streamed text: `IncrementalDetokenizer` never sends half of a multi-byte character, and
`TextStream` adds stop strings, whose text is never sent. Pure Python: no grpc, zmq or torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from controller.scheduler.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)


class Tokenizer:
    """Encoding, decoding and the chat template of one model folder."""

    def __init__(
        self,
        backend: BackendTokenizer,
        config: Mapping[str, Any],
        generation_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self._literal_backend: BackendTokenizer | None = None
        self.special_tokens = {
            name: _token_content(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self.bos_token_id = self._token_id(self.special_tokens["bos_token"])
        self.eos_token_id = self._token_id(self.special_tokens["eos_token"])
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        # When tokenizer.json's post-processor already adds BOS/EOS (Llama 3 style), adding them
        # again from the flags would double them.
        self._post_processor_adds = bool(backend.encode("", add_special_tokens=True).ids)
        eos_ids = set(generation_eos_token_ids)
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        """Ids that end generation: tokenizer_config's eos plus generation_config's."""
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Loads tokenizer.json, tokenizer_config.json and (when present) generation_config.json
        and chat_template.jinja from a Hugging Face style folder."""
        folder = Path(model_dir)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ConfigError("model_dir", str(folder), "a folder with tokenizer.json")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        eos = generation.get("eos_token_id")  # an id, a list of ids, or absent
        eos_ids = [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():  # newer transformers save the template beside the config
            template: str | None = template_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(config.get("chat_template"))
        return cls(backend, config, eos_ids, template)

    # ---- ids <-> text ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(
        self, text: str, *, add_special_tokens: bool = True, parse_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `text`.

        add_special_tokens: add BOS/EOS as the tokenizer is configured to (not for text that a
        chat template already rendered). parse_special_tokens: False encodes `<|im_end|>` and
        the like in `text` as ordinary characters, so user text cannot forge control tokens.
        """
        backend = self.backend if parse_special_tokens else self._literal()
        ids: list[int] = backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and not self._post_processor_adds:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def encode_prompt(
        self, text: str, apply_chat_template: bool, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """A Generate prompt's ids: as is, or wrapped as one user message in the chat template
        (offered the tools, when given)."""
        if not apply_chat_template:
            return self.encode(text)
        rendered = self.apply_chat_template([{"role": "user", "content": text}], tools=tools)
        return self.encode(rendered, add_special_tokens=False)

    def _literal(self) -> BackendTokenizer:
        # A second copy that treats special-token text (`<|im_start|>`) as plain text; the flag
        # lives on the Rust object, so one copy per mode rather than toggling a shared one.
        if self._literal_backend is None:
            literal = BackendTokenizer.from_str(self.backend.to_str())
            literal.encode_special_tokens = True
            self._literal_backend = literal
        return self._literal_backend

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ---- chat template ---------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as the model was trained to read it, like transformers'
        `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`."""
        if self.chat_template is None:
            raise InvalidRequestError("apply_chat_template", "the model has no chat template")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        context = {**self.special_tokens, **template_kwargs}
        try:
            return self._compiled_template.render(
                messages=_plain(list(messages)),
                add_generation_prompt=add_generation_prompt,
                tools=_plain(context.pop("tools", None)),
                documents=None,
                **_plain(context),
            )
        except jinja2.TemplateError as err:
            raise InvalidRequestError("messages", f"the chat template refused them: {err}") from err


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in the sandbox, with the helpers Hub templates expect."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    def strftime_now(format_spec: str) -> str:
        return datetime.now().strftime(format_spec)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env.from_string(source)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, as transformers does: templates come from
    model files, and `ns.__class__`-style attributes are the classic sandbox escape."""

    def __setitem__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")
        super().__setitem__(name, value)


def _plain(value: Any) -> Any:
    """Only JSON-like data reaches the template, never objects with methods."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return str(value)


def _token_content(entry: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken dict.
    if isinstance(entry, dict):
        content = entry.get("content")
        return content if isinstance(content, str) else None
    return entry if isinstance(entry, str) else None


def _pick_template(entry: Any) -> str | None:
    # A single template, or a list of named ones of which "default" is the chat template.
    if isinstance(entry, str) or entry is None:
        return entry
    if isinstance(entry, list):
        named = {item.get("name"): item.get("template") for item in entry if isinstance(item, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


class IncrementalDetokenizer:
    """One sequence's output ids -> text deltas, never ending in a partial character.

    Each token goes through the tokenizers library's own incremental decoder (`DecodeStream`,
    in Rust: about 0.5 us a token, where decoding a window twice in Python cost 10 us, the
    largest part of the controller's step at a thousand decodes). `flush` decodes the held tail
    itself: it restarts at `prefix_offset`, a few tokens back, and subtracts that window's text.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        """Where the decoding window of `flush` starts."""
        self.read_offset = 0
        """Tokens before this have been turned into text already."""
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_ids: Iterable[int]) -> str:
        """Adds tokens; returns the new text, or "" while a character is still incomplete."""
        return "".join(map(self.push_one, token_ids))

    def push_one(self, token_id: int) -> str:
        """push([token_id]) without the loop: the engine calls it for every token it streams."""
        ids = self.token_ids
        ids.append(token_id)
        delta = self._stream.step(self.tokenizer.backend, token_id)
        if not delta:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return str(delta)

    def flush(self) -> str:
        """At the end of the sequence: the text still held back, a broken character included."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        ids = self.token_ids[start:end]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def find_stop_string(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text`, or None."""
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        index = text.find(stop)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def safe_to_send_len(pending: str, stop_strings: Sequence[str]) -> int:
    """How much of `pending` (text with no stop string in it) can be sent now: all of it but the
    longest tail that is the beginning of some stop string, which the next tokens may complete."""
    held = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(pending)), held, -1):
            if pending.endswith(stop[:length]):
                held = length
                break
    return len(pending) - held


class TextStream:
    """One request's streamed text: incremental detokenization plus stop strings.

    `push` returns what may be sent now; when a stop string appears, the text ends right before
    it, `stop_string` says which one, and the engine finishes the sequence. Text that might be
    the start of a stop string is held until it is known not to be one (or `finish` is called).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_strings: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not stop for stop in stop_strings):
            raise InvalidRequestError("stop", "a stop string is empty")
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens
        )
        self.stop_strings = tuple(stop_strings)
        self.stop_string: str | None = None
        """The stop string that ended the text, once one has."""
        self._pending = ""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Adds one sampled token; returns (text safe to send now, whether a stop string ended
        the text). After a stop, further tokens add nothing."""
        if not self.stop_strings:  # the common case, once per token of every stream
            return self.detokenizer.push_one(token_id), False
        if self.stop_string is not None:
            return "", True
        self._pending += self.detokenizer.push_one(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """At the end of generation (EOS, length): all text still held back."""
        if self.stop_string is not None:
            return ""
        self._pending += self.detokenizer.flush()
        text, _ = self._release(final=True)
        return text

    def _release(self, *, final: bool) -> tuple[str, bool]:
        found = find_stop_string(self._pending, self.stop_strings)
        if found is not None:
            index, self.stop_string = found
            text, self._pending = self._pending[:index], ""
        else:
            cut = (
                len(self._pending) if final else safe_to_send_len(self._pending, self.stop_strings)
            )
            text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, self.stop_string is not None
