"""A byte-level BPE GGUF tokenizer as `tokenizer.json` and `tokenizer_config.json`.

llama.cpp stores a GPT-2 style vocabulary as three arrays: the tokens (already spelled in the
byte-to-unicode alphabet, e.g. `Ġthe`), the merges (`"Ġ t"`, best first) and a type per token
(1 normal, 3 control, 4 user-defined). `tokenizer.ggml.pre` names the pre-tokenizer regex the
vocabulary was trained with; we rebuild that with the `tokenizers` library so ids match exactly.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from sarathictl.model_prep.errors import ModelPrepError
from sarathictl.model_prep.gguf_config import LlamaShape, read_field

# llama.cpp token types (llama_token_type in llama.h).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def _gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _individual_digits_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm"/"starcoder" pre-tokenizer: every digit on its own (`\p{N}`), then the
    # GPT-2 regex; it is what SmolLM2's own tokenizer.json says (Digits + ByteLevel).
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_pre_tokenizer()]
    )


# tokenizer.ggml.pre -> how text is split before BPE. Others are refused rather than guessed.
PRE_TOKENIZERS = {
    "default": _gpt2_pre_tokenizer,
    "gpt-2": _gpt2_pre_tokenizer,
    "gpt2": _gpt2_pre_tokenizer,
    "smollm": _individual_digits_pre_tokenizer,
    "starcoder": _individual_digits_pre_tokenizer,
}


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """The GGUF's vocabulary as a `tokenizers.Tokenizer` that encodes as llama.cpp does."""
    model_kind = read_field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ModelPrepError(
            f"tokenizer.ggml.model={model_kind!r} is not supported: only byte-level BPE ('gpt2')"
        )
    pre_kind = read_field(reader, "tokenizer.ggml.pre", "default")
    if pre_kind not in PRE_TOKENIZERS:
        raise ModelPrepError(
            f"tokenizer.ggml.pre={pre_kind!r} is not supported: one of {sorted(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = list(read_field(reader, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(read_field(reader, "tokenizer.ggml.token_type"))
    if len(token_types) != len(tokens):
        raise ModelPrepError(
            f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelPrepError("tokenizer.ggml.tokens holds the same token twice")
    merges = [_split_merge(merge) for merge in read_field(reader, "tokenizer.ggml.merges")]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre_kind]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>, ...) must be matched whole in text and skipped when decoding
    # with skip_special_tokens; user-defined ones are matched whole but decoded like text.
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user_defined)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ModelPrepError("adding the control tokens changed the vocabulary size")
    return tokenizer


def _split_merge(merge: str) -> tuple[str, str]:
    # Byte-level spelling maps the space byte to "Ġ", so the single space is the separator.
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise ModelPrepError(f"tokenizer.ggml.merges holds a malformed merge {merge!r}")
    return left, right


def tokenizer_config_json(reader: GGUFReader, shape: LlamaShape) -> dict[str, Any]:
    """`tokenizer_config.json`: the special tokens by name and the chat template."""
    tokens: list[str] = list(read_field(reader, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(read_field(reader, "tokenizer.ggml.token_type"))

    def token_at(key: str) -> str | None:
        field = reader.fields.get(key)
        return None if field is None else tokens[int(field.contents())]

    config: dict[str, Any] = {
        # The class that loads tokenizer.json as is, with no model-specific rebuilding.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(read_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(read_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "bos_token": tokens[shape.bos_token_id],
        "eos_token": tokens[shape.eos_token_id],
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "additional_special_tokens": [
            token
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == TOKEN_TYPE_CONTROL
        ],
        "model_max_length": shape.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    chat_template = reader.fields.get("tokenizer.chat_template")
    if chat_template is not None:
        config["chat_template"] = chat_template.contents()
    return config
