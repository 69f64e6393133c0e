"""Normalization layers, computed the way the reference implementations compute them."""

from __future__ import annotations

import torch
from torch import nn

from stage_worker.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]; normalized in float32 so bf16 activations lose nothing, then
        # scaled in the model dtype, as the reference implementation does
        kernels = fused.kernels_for(x)
        if kernels is not None:
            out: torch.Tensor = kernels.rms_norm(x, self.weight, self.eps)
            return out
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm after it: (x + delta, norm(x + delta)), [num_tokens,
        hidden] each; one kernel on CUDA, where each is a launch of almost no work at decode."""
        if x.is_cuda and (kernels := fused.kernels_for(x)) is not None:
            both: tuple[torch.Tensor, torch.Tensor] = kernels.add_rms_norm(
                x, delta, self.weight, self.eps
            )
            return both
        total = x + delta
        return total, self.forward(total)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        self.bias = nn.Parameter(
            torch.zeros(hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]
        return nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
