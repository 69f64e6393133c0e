"""controller.tokenizer: encoding, chat template, streamed text without broken characters, and
stop strings whose text is never sent. The tokenizer is a tiny byte-level BPE built here, so that
CJK characters and emoji are split across several tokens on purpose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from controller.scheduler.errors import ConfigError, InvalidRequestError
from controller.tokenizer import (
    IncrementalDetokenizer,
    TextStream,
    Tokenizer,
    safe_to_send_len,
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_chars(text: str) -> str:
    """`text`'s UTF-8 bytes spelled in the byte-level BPE alphabet (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return "".join(mapping[b] for b in text.encode("utf-8"))


def make_backend() -> BackendTokenizer:
    """Byte-level BPE: every byte is a token, plus a few merges. "日" becomes two tokens (its
    first two bytes merged, then the third), an emoji four, "Paris" two ("Pa", "ris")."""
    merges = [
        (byte_chars(" "), "t"),
        ("h", "e"),
        ("P", "a"),
        ("r", "i"),
        ("ri", "s"),
        (byte_chars("日")[0], byte_chars("日")[1]),
    ]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return backend


def make_tokenizer(*, chat_template: str | None = CHATML_TEMPLATE, **config: Any) -> Tokenizer:
    tokenizer_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", **config}
    return Tokenizer(make_backend(), tokenizer_config, chat_template=chat_template)


def stream_deltas(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push([token_id]) for token_id in token_ids]
    return [*deltas, detokenizer.flush()]


def stream_with_stops(
    tokenizer: Tokenizer, text: str, stops: list[str]
) -> tuple[list[str], TextStream, int]:
    """Streams `text` token by token; returns the deltas, the stream and how many tokens ran."""
    stream = TextStream(tokenizer, stops)
    deltas = []
    num_pushed = 0
    for token_id in tokenizer.encode(text):
        num_pushed += 1
        delta, stopped = stream.push(token_id)
        deltas.append(delta)
        if stopped:
            return deltas, stream, num_pushed
    deltas.append(stream.finish())
    return deltas, stream, num_pushed


# ---- encoding ------------------------------------------------------------------------------------
def test_multibyte_characters_are_split_across_tokens_and_round_trip() -> None:
    tokenizer = make_tokenizer()
    for text in ("日本語", "🤖🎉", "naïve café", "the Paris"):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("🤖")) == 4  # one token per byte: the split the tests rely on
    assert len(tokenizer.encode("日")) == 2


def test_special_tokens_in_text_are_parsed_unless_asked_not_to() -> None:
    tokenizer = make_tokenizer()
    im_end = tokenizer.backend.token_to_id("<|im_end|>")
    assert tokenizer.encode("<|im_end|>") == [im_end]
    literal = tokenizer.encode("<|im_end|>", parse_special_tokens=False)
    assert im_end not in literal
    assert tokenizer.decode(literal) == "<|im_end|>"


def test_bos_is_added_once_when_the_config_asks() -> None:
    with_bos = make_tokenizer(add_bos_token=True)
    without = make_tokenizer()
    bos = with_bos.bos_token_id
    assert with_bos.encode("he") == [bos, *without.encode("he")]
    assert with_bos.encode("he", add_special_tokens=False) == without.encode("he")


def test_from_dir_reads_configs_and_unions_eos_ids(tmp_path: Path) -> None:
    make_backend().save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "chat_template": [{"name": "default", "template": CHATML_TEMPLATE}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.eos_token_ids == {0, 2}
    assert tokenizer.bos_token_id == 1
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith(
        "<|im_start|>assistant\n"
    )


def test_a_folder_without_tokenizer_json_names_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Tokenizer.from_dir(tmp_path)
    assert info.value.field == "model_dir"


# ---- chat template -------------------------------------------------------------------------------
def test_chat_template_renders_like_chatml() -> None:
    tokenizer = make_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本?"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n日本?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_chat_template_raise_exception_becomes_an_invalid_request() -> None:
    with pytest.raises(InvalidRequestError, match="unknown role robot") as info:
        make_tokenizer().apply_chat_template([{"role": "robot", "content": "x"}])
    assert info.value.field == "messages"


def test_encode_prompt_wraps_the_prompt_as_a_user_message() -> None:
    tokenizer = make_tokenizer()
    ids = tokenizer.encode_prompt("hi", apply_chat_template=True)
    im_start = tokenizer.backend.token_to_id("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 2
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert tokenizer.encode_prompt("hi", apply_chat_template=False) == tokenizer.encode("hi")


def test_a_model_without_chat_template_refuses_the_chat_flag() -> None:
    with pytest.raises(InvalidRequestError) as info:
        make_tokenizer(chat_template=None).encode_prompt("hi", apply_chat_template=True)
    assert info.value.field == "apply_chat_template"


# ---- incremental detokenization ------------------------------------------------------------------
def test_emoji_and_cjk_are_held_back_until_complete() -> None:
    tokenizer = make_tokenizer()
    text = "he 日本 🤖!"
    ids = tokenizer.encode(text)
    deltas = stream_deltas(tokenizer, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert "🤖" in deltas  # the emoji arrives whole, in one delta
    emoji_start = len(tokenizer.encode("he 日本 "))
    assert deltas[emoji_start : emoji_start + 3] == ["", "", ""]  # its first three bytes held


def test_special_tokens_add_no_text_to_the_stream() -> None:
    tokenizer = make_tokenizer()
    ids = [*tokenizer.encode("he"), tokenizer.eos_token_id or 0]
    assert "".join(stream_deltas(tokenizer, ids)) == "he"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab Pris日本語éü🤖🎉\n"), max_size=40))
def test_deltas_of_any_text_concatenate_to_the_text_without_broken_characters(text: str) -> None:
    tokenizer = make_tokenizer()
    deltas = stream_deltas(tokenizer, tokenizer.encode(text))
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode(text)) == text
    assert all("\ufffd" not in delta for delta in deltas)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=264), max_size=30))
def test_deltas_of_any_ids_concatenate_to_decode_even_for_invalid_bytes(ids: list[int]) -> None:
    tokenizer = make_tokenizer()
    assert "".join(stream_deltas(tokenizer, ids)) == tokenizer.decode(ids)


# ---- stop strings --------------------------------------------------------------------------------
def test_stop_string_across_token_boundaries_is_never_sent() -> None:
    tokenizer = make_tokenizer()
    assert len(tokenizer.encode("Paris")) == 2  # "Pa" + "ris": the stop spans two tokens
    deltas, stream, num_pushed = stream_with_stops(tokenizer, "the Paris he", ["Paris"])
    assert "".join(deltas) == "the "
    assert stream.stop_string == "Paris"
    assert num_pushed == len(tokenizer.encode("the Paris"))  # stopped at the token completing it
    assert "Pa" not in "".join(deltas)


def test_a_held_stop_prefix_is_released_when_it_turns_out_not_to_be_one() -> None:
    tokenizer = make_tokenizer()
    deltas, stream, _ = stream_with_stops(tokenizer, "Pa Pa", ["Paris"])
    assert "".join(deltas) == "Pa Pa"
    assert deltas[-1] == "Pa"  # the tail could still have become "Paris": sent only at finish
    assert stream.stop_string is None


def test_stop_string_starting_inside_an_emoji() -> None:
    tokenizer = make_tokenizer()
    deltas, stream, _ = stream_with_stops(tokenizer, "he日🤖 after", ["🤖"])
    assert "".join(deltas) == "he日"
    assert stream.stop_string == "🤖"


def test_earliest_of_several_stop_strings_wins() -> None:
    tokenizer = make_tokenizer()
    deltas, stream, _ = stream_with_stops(tokenizer, "a he b Paris c", ["Paris", "he"])
    assert "".join(deltas) == "a "
    assert stream.stop_string == "he"


def test_pushing_after_a_stop_sends_nothing() -> None:
    tokenizer = make_tokenizer()
    stream = TextStream(tokenizer, ["he"])
    for token_id in tokenizer.encode("he"):
        stream.push(token_id)
    assert stream.push(tokenizer.encode("a")[0]) == ("", True)
    assert stream.finish() == ""


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(InvalidRequestError):
        TextStream(make_tokenizer(), [""])


@pytest.mark.parametrize(
    ("pending", "stops", "expected"),
    [
        ("hello Pa", ["Paris"], len("hello ")),
        ("hello Par", ["ar!", "Paris"], len("hello ")),  # the longest possible start is held
        ("hello ar", ["ar!", "Paris"], len("hello ")),
        ("hello", ["Paris"], len("hello")),
        ("", ["Paris"], 0),
        ("abc", [], 3),
    ],
)
def test_safe_to_send_len_holds_only_a_possible_stop_start(
    pending: str, stops: list[str], expected: int
) -> None:
    assert safe_to_send_len(pending, stops) == expected


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet=st.sampled_from("ab Pris日本🤖"), max_size=30),
    st.text(alphabet=st.sampled_from("ab Pris日本🤖"), min_size=1, max_size=4),
)
def test_streamed_text_always_ends_right_before_the_first_stop(text: str, stop: str) -> None:
    tokenizer = make_tokenizer()
    deltas, stream, _ = stream_with_stops(tokenizer, text, [stop])
    index = text.find(stop)
    assert "".join(deltas) == (text if index < 0 else text[:index])
    assert stream.stop_string == (None if index < 0 else stop)
