"""Rotary position embedding (rotate-half form, as Llama and Falcon use), with Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from stage_worker.config import RopeScaling
from stage_worker.layers import fused


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    # [head_dim / 2], float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are divided by factor, short ones kept, a smooth ramp between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Computes cos/sin for the positions of one step, then rotates q and k of every layer."""

    def __init__(
        self, head_dim: int, theta: float, scaling: RopeScaling | None, device: str
    ) -> None:
        self.inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # positions: [num_tokens] -> cos, sin: [num_tokens, 1, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim]
        kernels = fused.kernels_for(x)
        if kernels is not None:
            out: torch.Tensor = kernels.rotary(x, cos, sin)
            return out
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
