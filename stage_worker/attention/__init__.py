"""Attention over the paged KV cache for a ragged batch of prefill chunks and decodes."""

from stage_worker.attention.base import AttentionBackend, AttentionMetadata, SeqSlice
from stage_worker.attention.torch_backend import TorchAttention


def make_backend(name: str, device: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "flashinfer":
        from stage_worker.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(device)
    raise ValueError(f"attention={name!r}: must be torch or flashinfer")


__all__ = ["AttentionBackend", "AttentionMetadata", "SeqSlice", "make_backend"]
