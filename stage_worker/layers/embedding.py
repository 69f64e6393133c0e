"""Vocabulary-parallel embedding and LM head: rank r holds vocabulary rows
[r * per_rank, min(vocab, (r + 1) * per_rank)) with per_rank = ceil(vocab / tp)."""

from __future__ import annotations

import torch
from torch import nn

from stage_worker.comm import TPGroup
from stage_worker.layers import cpu_matmul, exact_logits, gemv, matmul_bf16, onednn
from stage_worker.layers.linear import linear


def vocab_range(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    per_rank = -(-vocab_size // tp)
    start = min(vocab_size, tp_rank * per_rank)
    return start, min(vocab_size, start + per_rank)


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TPGroup, device: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.stop = vocab_range(vocab_size, tp.size, tp.rank)
        # weight: [vocab_local, hidden]
        self.weight = nn.Parameter(
            torch.empty(self.stop - self.start, hidden_size, device=device, dtype=dtype),
            requires_grad=False,
        )
        # The rows as the float32 matmul kernel's panels, when this rank's LM head is tied to
        # them and holds them so (ParallelLMHead.pack): then also `weight`, and read by rows().
        self.f32: cpu_matmul.PackedWeight | None = None

    def share_panels(self, packed: cpu_matmul.PackedWeight, weight: nn.Parameter) -> None:
        """Looks rows up in the tied head's panels (weight: their Parameter), freeing the
        plain rows."""
        self.f32, self.weight = packed, weight

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [num_tokens] -> [num_tokens, hidden]
        if self.tp.size == 1:
            return self._rows(token_ids)
        mine = (token_ids >= self.start) & (token_ids < self.stop)
        local = torch.where(mine, token_ids - self.start, 0)
        rows = self._rows(local)
        out = rows * mine[:, None].to(rows.dtype)
        return self.tp.all_reduce(out)

    def _rows(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.f32 is not None:
            return cpu_matmul.rows(self.f32, local_ids)
        return nn.functional.embedding(local_ids, self.weight)


class ParallelLMHead(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TPGroup, device: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start, self.stop = vocab_range(vocab_size, tp.size, tp.rank)
        # weight: [vocab_local, hidden]
        self.weight = nn.Parameter(
            torch.empty(self.stop - self.start, hidden_size, device=device, dtype=dtype),
            requires_grad=False,
        )
        # The weight in oneDNN's layout when it must also stay plain: a tied head shares its
        # rows with the embedding, whose lookups need the strided tensor (one extra copy).
        self.packed: torch.Tensor | None = None
        # The weight row-major for gemv.linear, when the small-batch kernel is on.
        self.plain: torch.Tensor | None = None
        # CPU bf16: the weight as the bf16 kernel's panels, for the rows of the kernel's reach
        # (matmul_bf16.REACH), logits in float32.
        self.bf16: matmul_bf16.PackedBf16 | None = None
        # The weight's rows as loaded, for the float32 recomputation of the top logits
        # (exact_logits.py) of a head that is not float32; an untied CPU bf16 head keeps them
        # beside its oneDNN copy.
        self.rows: torch.Tensor | None = None
        # CUDA: the matmul writes float32 logits from bf16 inputs (torch.mm's out_dtype)
        self.float32_out = False
        # CPU float32: the weight as the AVX2 matmul kernel's panels (cpu_matmul.py), then
        # also `weight`; a tied embedding on this rank then looks its rows up in them.
        self.f32: cpu_matmul.PackedWeight | None = None
        # CPU bf16 where the kernel takes every step: `bf16` is the only layout scoring (an
        # untied head's `weight` too), whatever matmul_bf16.REACH says later.
        self.panels_only = False

    def pack(self, embedding: VocabParallelEmbedding | None) -> None:
        """After load: the weight in the layout of the fastest kernel for it (no-op where
        F.linear is that). embedding: this rank's, when the head shares its rows."""
        shared_with_embedding = embedding is not None
        if cpu_matmul.usable_for(self.weight.data):
            self.f32 = cpu_matmul.pack(self.weight.data)
            self.weight = nn.Parameter(self.f32.panels, requires_grad=False)
            if embedding is not None:  # held once, as panels
                embedding.share_panels(self.f32, self.weight)
            return
        self.float32_out = self.weight.dtype != torch.float32 and _mm_float32_out(self.weight)
        if matmul_bf16.usable_for(self.weight.data) and matmul_bf16.REACH.max_tokens > 0:
            self.bf16 = matmul_bf16.pack(self.weight.data)
            if matmul_bf16.REACH.takes_every_step():  # the panels score every step
                self.panels_only = True
                if not shared_with_embedding:  # held once; a tied embedding keeps its rows
                    self.weight = nn.Parameter(self.bf16.panels, requires_grad=False)
                return
        if self.weight.dtype != torch.float32 and not self.float32_out:
            self.rows = self.weight.data
        if gemv.usable_for(self.weight.data):
            self.plain = self.weight.data  # for the GEMV kernel (the embedding's, when tied)
        if not onednn.can_pack(self.weight):
            return
        if shared_with_embedding:
            self.packed = onednn.pack(self.weight.data)
        else:
            self.weight = nn.Parameter(onednn.pack(self.weight.data), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden] -> logits [n, vocab] in float32 (every rank gets all of them)
        weight = self.packed if self.packed is not None else self.weight
        if self.f32 is not None:
            logits = cpu_matmul.linear(hidden, self.f32)
        elif self.float32_out:
            # the float32 sums handed back unrounded: no ties made by rounding, nothing to
            # refine (and no host sync for it)
            logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        elif self.bf16 is not None and (
            self.panels_only or hidden.shape[0] <= matmul_bf16.REACH.max_tokens
        ):
            # the CPU's bf16 kernel hands its float32 sums back unrounded too
            logits = matmul_bf16.linear(hidden, self.bf16, torch.float32)
        else:
            logits = linear(hidden, weight, self.plain).float()
            if self.rows is not None:  # rounded to the model dtype: the top ones made exact
                logits = exact_logits.refine(logits, hidden, self.rows)
        if self.tp.size == 1:
            return logits
        pad = self.per_rank - logits.shape[1]
        if pad:  # the last rank's share is shorter; all_gather needs equal sizes
            logits = nn.functional.pad(logits, (0, pad), value=float("-inf"))
        return self.tp.all_gather(logits)[:, : self.vocab_size]


def _mm_float32_out(weight: torch.Tensor) -> bool:
    """Whether torch can multiply `weight`'s dtype into float32 on its device (CUDA, torch 2.8
    and later: mm's out_dtype)."""
    if not weight.is_cuda:
        return False
    probe = torch.ones(2, 2, dtype=weight.dtype, device=weight.device)
    try:
        torch.mm(probe, probe, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True
