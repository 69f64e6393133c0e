"""One GGUF file -> one Hugging Face style model folder (config, weights, tokenizer)."""

from __future__ import annotations

import logging
from pathlib import Path

from gguf import GGUFReader
from safetensors.torch import save_file

from sarathictl.model_prep.defaults import MODEL_FILES
from sarathictl.model_prep.errors import ModelPrepError
from sarathictl.model_prep.files import (
    ensure_free_space,
    explained_os_errors,
    write_atomically,
    write_json_atomically,
)
from sarathictl.model_prep.gguf_config import config_json, generation_config_json, read_llama_shape
from sarathictl.model_prep.gguf_tokenizer import build_tokenizer, tokenizer_config_json
from sarathictl.model_prep.gguf_weights import (
    TORCH_DTYPES,
    ProgressCallback,
    convert_weights,
    num_parameters,
)

logger = logging.getLogger(__name__)

# tokenizer.json, configs and slack; the weights are counted from the GGUF.
_SMALL_FILES_BYTES = 32 << 20


def convert_gguf(
    gguf_path: Path, model_dir: Path, dtype: str, progress: ProgressCallback | None = None
) -> dict[str, int]:
    """Write MODEL_FILES into `model_dir`; returns their sizes in bytes by name."""
    if dtype not in TORCH_DTYPES:
        raise ModelPrepError(f"dtype={dtype!r} is invalid: one of {', '.join(TORCH_DTYPES)}")
    logger.debug("reading %s", gguf_path)
    reader = GGUFReader(gguf_path)
    shape = read_llama_shape(reader)
    weight_bytes = num_parameters(reader) * TORCH_DTYPES[dtype].itemsize
    ensure_free_space(model_dir, weight_bytes + _SMALL_FILES_BYTES, "the converted model")

    tokenizer = build_tokenizer(reader)
    with explained_os_errors(model_dir):
        write_json_atomically(model_dir / "config.json", config_json(shape, dtype))
        write_json_atomically(model_dir / "generation_config.json", generation_config_json(shape))
        write_atomically(model_dir / "tokenizer.json", lambda path: tokenizer.save(str(path)))
        write_json_atomically(
            model_dir / "tokenizer_config.json", tokenizer_config_json(reader, shape)
        )
        tensors = convert_weights(reader, shape, dtype, progress)
        write_atomically(
            model_dir / "model.safetensors",
            lambda path: save_file(tensors, str(path), metadata={"format": "pt"}),
        )
    return {name: (model_dir / name).stat().st_size for name in MODEL_FILES}
