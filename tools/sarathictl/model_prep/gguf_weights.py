"""A Llama GGUF's tensors as Hugging Face `model.safetensors` tensors.

Three things differ from a Hugging Face checkpoint: the names (`blk.3.attn_q.weight` is
`model.layers.3.self_attn.q_proj.weight`), the encoding (Q4_1 / Q8_0 blocks, dequantized here
with `gguf.quants.dequantize`) and the row order of attn_q / attn_k: llama.cpp's converter
permutes each head's rows from the "rotate half" layout of Hugging Face into interleaved pairs,
which we undo so the stage workers' rotary code sees the layout it was written for.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from sarathictl.model_prep.errors import ModelPrepError
from sarathictl.model_prep.gguf_config import LlamaShape

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

ProgressCallback = Callable[[int, int], None]
"""Called with (tensors done, tensors in all) after each tensor."""


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ModelPrepError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def expected_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> [out_features, in_features] (or [features]) for every tensor."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    q_rows = shape.num_attention_heads * shape.head_dim
    kv_rows = shape.num_key_value_heads * shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (shape.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, hidden)
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        shapes[prefix + "self_attn.q_proj.weight"] = (q_rows, hidden)
        shapes[prefix + "self_attn.k_proj.weight"] = (kv_rows, hidden)
        shapes[prefix + "self_attn.v_proj.weight"] = (kv_rows, hidden)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, q_rows)
        shapes[prefix + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of attn_q / attn_k rows.

    weight: [num_heads * head_dim, in_features]. llama.cpp wrote, per head, the rows in the order
    reshape(2, head_dim // 2) -> transpose: row pairs (i, i + head_dim/2) made adjacent. The
    inverse reads them as (head_dim // 2, 2) and transposes back.
    """
    num_rows = weight.shape[0]
    if num_rows % (2 * num_heads):
        raise ModelPrepError(f"{num_rows} rows do not split into {num_heads} heads of even size")
    half_head_dim = num_rows // num_heads // 2
    # [num_heads, half_head_dim, 2, in] -> [num_heads, 2, half_head_dim, in]
    per_head = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def dequantized(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as float32, [rows, columns] in row-major order (GGUF lists dims reversed)."""
    values = dequantize(tensor.data, tensor.tensor_type)
    expected = tuple(int(dim) for dim in reversed(tensor.shape))
    return np.asarray(values, dtype=np.float32).reshape(expected)


def convert_weights(
    reader: GGUFReader,
    shape: LlamaShape,
    dtype: str,
    progress: ProgressCallback | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized, renamed, un-permuted and cast to `dtype`, checked for shape."""
    if dtype not in TORCH_DTYPES:
        raise ModelPrepError(f"dtype={dtype!r} is invalid: one of {', '.join(TORCH_DTYPES)}")
    wanted = expected_shapes(shape)
    converted: dict[str, torch.Tensor] = {}
    for done, tensor in enumerate(reader.tensors, start=1):
        name = hf_tensor_name(tensor.name)
        weight = dequantized(tensor)
        if tensor.name.endswith("attn_q.weight"):
            weight = unpermute_rotary_rows(weight, shape.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = unpermute_rotary_rows(weight, shape.num_key_value_heads)
        if name not in wanted:
            raise ModelPrepError(f"GGUF tensor {tensor.name!r} ({name}) is not expected here")
        if tuple(weight.shape) != wanted[name]:
            raise ModelPrepError(
                f"GGUF tensor {tensor.name!r} has shape {list(weight.shape)}, "
                f"expected {list(wanted[name])} for {name}"
            )
        # np.array copies out of the read-only memory map, so torch owns writable memory.
        converted[name] = torch.from_numpy(np.array(weight)).to(TORCH_DTYPES[dtype])
        if progress is not None:
            progress(done, len(reader.tensors))
    missing = sorted(set(wanted) - set(converted))
    if missing:
        raise ModelPrepError(f"the GGUF lacks {len(missing)} tensors, e.g. {missing[0]}")
    return converted


def num_parameters(reader: GGUFReader) -> int:
    return sum(int(tensor.n_elements) for tensor in reader.tensors)
