"""bfloat16, the default dtype on CPUs that compute it (and on GPUs), against the float32
reference, the way vLLM's model tests compare with Hugging Face: greedy streams may part, but
where they first part each side's token must be among the other's top 5. Both sides of the
comparison go through what a user calls: our side is a local cluster (PP 1 and 2) answering
/v1/completions with `logprobs: 5`; the reference is transformers in float32 on the same folder
and prompt ids. transformers' own bf16 is measured beside ours on the same prompts: ours must stay
as close to float32 as it does, measured as each greedy token's log-probability against
float32's over the positions where the streams still agree. (How many of nine streams part
within 24 tokens is too coarse a measure to hold against: where float32's top two logits lie
0.04 to 0.11 apart, a rounding step decides, and on the AVX2 EPYC ours parted in 3 against
transformers' 1 or 2 while its log-probabilities were the closer, 0.014 against 0.017 off.)
And the demo's question gets the demo's answer.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from controller.tokenizer import Tokenizer
from tests.integration.test_demo_model import prepared_demo_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

NEW_TOKENS = 24
TOP = 5
CLOSENESS_SLACK = 1.25
"""Ours' mean log-probability error may be this many times transformers' bf16's: both round
the same weights to bf16 and differ in the order of sums, so neither is systematically the
closer (ours 0.86x on the AVX2 EPYC); an error twice as large means a step rounds somewhere
the reference does not."""
CHATS = [  # several kinds: fact, arithmetic, code, list, translation, format, story, other tongue
    "What is the capital of France?",
    "If I have 3 apples and buy 5 more, how many apples do I have?",
    "Write a Python function that reverses a string.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    'Give me a JSON object with keys "name" and "age" for a person.',
    "Tell me a very short story about a cat.",
    "Quelle est la plus grande planète du système solaire ?",
]
RAW = ["The history of the printing press begins"]


@dataclass(frozen=True)
class Stream:
    """A greedy continuation: its token ids, per position the top-5 token ids and the chosen
    token's log-probability."""

    tokens: list[int]
    top: list[list[int]]
    logprobs: list[float]
    finish_reason: str = "length"


def _prompts(tokenizer: Tokenizer) -> list[list[int]]:
    chats = [tokenizer.encode_prompt(text, apply_chat_template=True) for text in CHATS]
    return chats + [tokenizer.encode(text) for text in RAW]


def _reference(model_dir: Path, prompts: list[list[int]], dtype: Any) -> list[Stream]:
    """transformers' greedy streams in `dtype`, EOS ignored, with each position's top 5."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    streams = []
    with torch.no_grad():
        for prompt in prompts:
            tokens, top, logprobs, past = [], [], [], None
            step = torch.tensor([prompt])
            for _ in range(NEW_TOKENS):
                out = model(input_ids=step, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()  # [vocab]
                ranked = logits.topk(TOP).indices.tolist()
                tokens.append(ranked[0])
                top.append(ranked)
                logprobs.append(float(logits.log_softmax(-1)[ranked[0]]))
                step = torch.tensor([[ranked[0]]])
            streams.append(Stream(tokens, top, logprobs))
    return streams


def parted_at(ours: Stream, reference: Stream) -> int | None:
    """Where two greedy streams first differ (None: never)."""
    pairs = enumerate(zip(ours.tokens, reference.tokens, strict=True))
    return next((i for i, (a, b) in pairs if a != b), None)


def logprob_errors(streams: list[Stream], references: list[Stream]) -> list[float]:
    """|log-probability - the reference's| of each greedy token, over each stream's positions
    before it parts from its reference (after that the two continue different texts)."""
    errors = []
    for stream, reference in zip(streams, references, strict=True):
        shared = parted_at(stream, reference)
        for got, want in list(zip(stream.logprobs, reference.logprobs, strict=True))[:shared]:
            errors.append(abs(got - want))
    return errors


def close(ours: Stream, reference: Stream) -> bool:
    """vLLM's rule: equal up to the first difference, and there each side's token is in the
    other's top 5."""
    i = parted_at(ours, reference)
    return i is None or (ours.tokens[i] in reference.top[i] and reference.tokens[i] in ours.top[i])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=900) as response:  # bf16 is slow off AVX-512
        result: dict[str, Any] = json.load(response)
        return result


@dataclass(frozen=True)
class Served:
    port: int
    model: str
    tokenizer: Tokenizer
    log_dir: Path

    def log_tails(self, lines: int = 15) -> str:
        """The end of every process's log, for a failure's message."""
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            for log in sorted(self.log_dir.glob("*.log"))
        )

    def stream(self, prompt: list[int]) -> Stream:
        body = {"model": self.model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                "temperature": 0, "logprobs": TOP, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        choice = _post(self.port, "/v1/completions", body)["choices"][0]
        ids: dict[str, int] = {}  # a top entry's text back to its id
        top = []
        for alternatives in choice["logprobs"]["top_logprobs"]:
            ranked = sorted(alternatives.items(), key=lambda kv: -kv[1])
            top.append([self._id(text, ids) for text, _ in ranked])
        logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        return Stream(list(choice["token_ids"]), top, logprobs, choice["finish_reason"])

    def _id(self, text: str, cache: dict[str, int]) -> int:
        if not cache:
            for token_id in range(self.tokenizer.vocab_size):
                cache.setdefault(
                    self.tokenizer.decode([token_id], skip_special_tokens=False), token_id
                )
        return cache.get(text, -1)


@pytest.fixture(scope="module", params=[1, 2], ids=["pp1", "pp2"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    model_dir = prepared_demo_dir()
    port = _free_port()
    log_dir = tmp_path_factory.mktemp("logs")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sarathictl.cli", "up", "--local", "--pp", str(request.param),
         "--model", str(model_dir), "--port", str(_free_port()), "--http-port", str(port),
         "--dtype", "bfloat16", "--kv-cache-mb", "64",
         "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"sarathictl up exited:\n{proc.communicate()[0][-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                    model = json.load(r)["data"][0]["id"]
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the bf16 cluster did not serve in time"
                time.sleep(1.0)
        yield Served(port, model, Tokenizer.from_dir(model_dir), log_dir)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def references() -> tuple[list[list[int]], list[Stream], list[Stream]]:
    """The prompts, transformers' float32 streams and its bf16 streams."""
    model_dir = prepared_demo_dir()
    prompts = _prompts(Tokenizer.from_dir(model_dir))
    return (
        prompts,
        _reference(model_dir, prompts, torch.float32),
        _reference(model_dir, prompts, torch.bfloat16),
    )


def test_bf16_streams_stay_close_to_float32_as_transformers_bf16_does(
    served: Served, references: tuple[list[list[int]], list[Stream], list[Stream]]
) -> None:
    prompts, float32, hf_bf16 = references
    with ThreadPoolExecutor(len(prompts)) as pool:  # batched by the scheduler, as users send
        ours = list(pool.map(served.stream, prompts))
    cut = [
        (i, len(o.tokens), o.finish_reason)
        for i, o in enumerate(ours)
        if len(o.tokens) < NEW_TOKENS
    ]
    assert not cut, f"(prompt, tokens, finish reason) cut short: {cut}\n{served.log_tails()}"
    not_close = [i for i, (o, r) in enumerate(zip(ours, float32, strict=True)) if not close(o, r)]
    assert not not_close, f"prompts {not_close} part from float32 beyond each other's top 5"
    ours_parted = sum(parted_at(o, r) is not None for o, r in zip(ours, float32, strict=True))
    hf_parted = sum(parted_at(h, r) is not None for h, r in zip(hf_bf16, float32, strict=True))
    ours_error = statistics.fmean(logprob_errors(ours, float32))
    hf_error = statistics.fmean(logprob_errors(hf_bf16, float32))
    print(f"parted from float32 in {NEW_TOKENS} tokens: ours bf16 {ours_parted}, "
          f"transformers bf16 {hf_parted} of {len(prompts)} prompts; mean log-probability "
          f"error before that: ours {ours_error:.4f}, transformers {hf_error:.4f}")  # fmt: skip
    assert ours_error <= CLOSENESS_SLACK * hf_error, (ours_error, hf_error)


def test_the_demo_question_is_answered_with_paris_in_bf16(served: Served) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": served.model, "max_tokens": 32, "temperature": 0, "messages": question}
    answer = _post(served.port, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
