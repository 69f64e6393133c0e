"""A tiny servable model folder: random Llama weights (transformers' save_pretrained) and the
benchmarks' byte-level BPE tokenizer with a chat template. Tests only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from sarathictl.bench.random_model import write_byte_tokenizer
from sarathictl.local_cluster import LocalCluster

from tests.unit.stage_worker import tiny_models

VOCAB_SIZE = 320  # the tokenizer uses 300 of them; the rest are never produced by it

REPO_ROOT = Path(__file__).resolve().parents[2]
Cluster = TypeVar("Cluster", bound=LocalCluster)


@dataclass
class PatchedCluster(LocalCluster):
    """A local cluster whose children named `patched` ("controller", or "stage" for every
    worker) run `module` instead: the same process with one test fault planted, configured by
    extra_env. A restart passes the args kept by _spawn: the same module again."""

    patched: str = ""
    module: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        if self.patched and name.startswith(self.patched):
            args = ["-m", self.module, *args[2:]]  # args[:2]: -m and the package's own name
            env = dict(env, PYTHONPATH=str(REPO_ROOT), **self.extra_env)
        super()._spawn(name, args, env)


@contextmanager
def supervised(cluster: Cluster, start_timeout_s: float = 240) -> Iterator[Cluster]:
    """The cluster started, with what `sarathictl up` does meanwhile: restart the children
    that exit (workers told to, or crashed); stopped after."""
    cluster.start(timeout_s=start_timeout_s)
    stopped = threading.Event()

    def supervise() -> None:
        while not stopped.wait(0.2):
            cluster.supervise()

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    try:
        yield cluster
    finally:
        stopped.set()
        supervisor.join()
        cluster.stop()


def make_tiny_served_model(out_dir: Path, seed: int = 0, num_layers: int = 4) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    eos_id = write_byte_tokenizer(out_dir, vocab_size=300)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: no near-tied greedy choices
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, (4.0 if "embed" in name else 1.0) / p.shape[1] ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def oracle_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, ignoring EOS, in float32."""
    return oracle_greedy_many(model_dir, [prompt], max_new_tokens)[0]


def oracle_greedy_many(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ignoring EOS, in float32 (the model is
    loaded once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [tiny_models.oracle_greedy(model, prompt, max_new_tokens) for prompt in prompts]
