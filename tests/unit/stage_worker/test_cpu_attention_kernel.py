"""The CPU attention kernel (stage_worker/attention/cpu_kernel.py) against the torch path it
replaces: decodes on ragged contexts over shuffled blocks, and whole steps of prompt chunks
(first and later ones) beside decodes through the torch backend. float32 runs wherever the
kernel does (AVX2 with FMA: paged_attention_avx2.c, or AVX-512), bf16 only on AVX-512."""

from __future__ import annotations

import pytest
import torch

from stage_worker.attention import SeqSlice, cpu_kernel
from stage_worker.attention.base import build_metadata
from stage_worker.attention.torch_backend import TorchAttention, paged_decode

BLOCK_SIZE = 16

needs_kernel = pytest.mark.skipif(
    not cpu_kernel.available(), reason="the CPU attention kernel cannot run here (no AVX2)"
)
DTYPES = [torch.float32, torch.bfloat16]


def skip_unless_taken(dtype: torch.dtype) -> None:
    if not cpu_kernel.takes_dtype(dtype):
        pytest.skip(f"the kernel takes no {dtype} caches on this CPU (bf16 needs AVX-512)")


def _case(
    lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, ...]:
    """q [B, Hq, D], caches [blocks, bs, Hkv, D], a shuffled block table [B, max_blocks]."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks out of order
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.int64)
    at = 0
    for b, n in enumerate(blocks_per):
        table[b, :n] = torch.tensor(order[at : at + n])
        at += n
    shape = (num_blocks, block_size, hkv, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = (torch.randn(len(lens), hq, d, generator=gen) * 2).to(dtype)  # sharper softmax
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int64)


def _reference(q, k_cache, v_cache, table, lens) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The torch path in float32: [B, Hq, D]."""
    max_len = int(lens.max())
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    return paged_decode(q.float(), k_cache.float(), v_cache.float(), table.flatten(), max_len, mask)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # float32: summation order only; bf16: the output rounded once (2^-8 relative)
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=4e-3)


@needs_kernel
@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d"),
    [
        ([1], 4, 4, 64),  # one position, no grouping
        ([17, 600, 33, 1, 250], 9, 3, 64),  # the demo model's heads, ragged, block tails
        ([300, 129], 29, 1, 64),  # Falcon-180B's TP-4 group of 29 query heads
        ([5, 40], 8, 2, 128),
        ([64], 2, 1, 256),
        ([20, 3], 2, 1, 48),  # an odd number of 16-value pieces
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_decodes_match_the_torch_path(
    lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, threads: int
) -> None:
    skip_unless_taken(dtype)
    q, k_cache, v_cache, table, context = _case(lens, hq, hkv, d, dtype, seed=len(lens) + d)
    scratch = torch.empty(cpu_kernel.scratch_floats(hq, hkv, max(lens), threads))
    got = cpu_kernel.attend(q, k_cache, v_cache, table, context, scratch, threads)
    assert got.shape == q.shape and got.dtype == dtype
    want = _reference(q, k_cache, v_cache, table, context)
    torch.testing.assert_close(got.float(), want, **_tolerance(dtype))  # type: ignore[arg-type]


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 5, 12, 24])
@pytest.mark.parametrize("dtype", DTYPES)
def test_any_block_size_matches_the_torch_path(block_size: int, dtype: torch.dtype) -> None:
    """The AVX2 kernel takes key rows eight at a time within a block and the rest one at a
    time: blocks shorter than eight, and blocks of eight plus a rest, give the same output."""
    skip_unless_taken(dtype)
    lens = [3, 8, 29, 100]
    q, k_cache, v_cache, table, context = _case(lens, 9, 3, 64, dtype, 11, block_size)
    scratch = torch.empty(cpu_kernel.scratch_floats(9, 3, max(lens), 2))
    got = cpu_kernel.attend(q, k_cache, v_cache, table, context, scratch, 2)
    want = _reference(q, k_cache, v_cache, table, context)
    torch.testing.assert_close(got.float(), want, **_tolerance(dtype))  # type: ignore[arg-type]


def _chunk_case(
    chunks: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    """Prompt chunks (first position, tokens) of one sequence each: every token of a chunk
    repeats its sequence's table row and attends one position more than the token before (as
    the backend prepares a step); q [T, Hq, D], caches, table [T, max_blocks], lens [T]."""
    q, k_cache, v_cache, seq_tables, _ = _case(
        [p0 + n for p0, n in chunks], hq, hkv, d, dtype, seed, block_size
    )
    rows = [seq_tables[s] for s, (_, n) in enumerate(chunks) for _ in range(n)]
    lens = [p0 + t + 1 for p0, n in chunks for t in range(n)]
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(seed)) * 2
    return q.to(dtype), k_cache, v_cache, torch.stack(rows), torch.tensor(lens, dtype=torch.int64)


CHUNKS = [(0, 1), (0, 37), (100, 9), (513, 26), (7, 1)]
"""First chunks, later chunks over a cached prefix, chunks shorter than a tile and longer,
beside decodes (chunks of one token)."""


@needs_kernel
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "block_size"),
    [
        (9, 3, 64, 16),  # the demo model: tiles of 8 tokens, 24 query vectors
        (9, 3, 64, 5),  # blocks that end inside a tile of 4 key rows
        (4, 4, 48, 12),  # no grouping: 24 tokens a tile, remainders of 1 and 2 vectors; 48 values
        (10, 2, 80, 16),  # 5 query heads a KV head: tiles of 4 tokens, 20 vectors
        (7, 1, 32, 1),  # 7 query heads: tiles of 3 tokens; one-row blocks: no tile of 4 rows
        (29, 1, 64, 16),  # Falcon-180B's TP-4 group: one token a tile, the per-token path
        (8, 2, 128, 16),  # Mistral-7B's head size: 64 key pairs, 8 value vectors a row
        (4, 1, 256, 16),  # the widest head the kernels take: 16 value vectors a row
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_chunks_match_the_torch_path(
    hq: int, hkv: int, d: int, block_size: int, dtype: torch.dtype
) -> None:
    """A chunk's tokens go in tiles that share each key and value row (float32 on AVX2,
    chunk_attention_avx2.c; bf16 on AVX-512, chunk_attention_avx512.c, whose keys are
    transposed 16 rows at a time: head sizes of one, two and three such pieces of 16 pairs)."""
    skip_unless_taken(dtype)
    q, k_cache, v_cache, table, lens = _chunk_case(CHUNKS, hq, hkv, d, block_size, hq + d, dtype)
    scratch = torch.empty(cpu_kernel.scratch_floats(hq, hkv, int(lens.max()), 2))
    got = cpu_kernel.attend(q, k_cache, v_cache, table, lens, scratch, 2)
    assert got.dtype == dtype
    want = _reference(q, k_cache, v_cache, table, lens)
    torch.testing.assert_close(got.float(), want, **_tolerance(dtype))  # type: ignore[arg-type]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_later_tokens_value_does_not_reach_an_earlier_token(dtype: torch.dtype) -> None:
    """Causal in values too: a chunk's tokens share a tile, and the tile reads rows up to its
    last token's; a non-finite value in the last token's row must leave the others finite."""
    skip_unless_taken(dtype)
    q, k_cache, v_cache, table, lens = _chunk_case([(0, 8)], 9, 3, 64, BLOCK_SIZE, 3, dtype)
    last = int(lens[-1]) - 1  # position 7: only the chunk's last token attends it
    v_cache[table[0, last // BLOCK_SIZE], last % BLOCK_SIZE] = float("inf")
    scratch = torch.empty(cpu_kernel.scratch_floats(9, 3, int(lens.max()), 1))
    got = cpu_kernel.attend(q, k_cache, v_cache, table, lens, scratch, 1)
    assert got[:-1].isfinite().all()
    assert not got[-1].isfinite().all()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_change_nothing(dtype: torch.dtype) -> None:
    """Each (token, KV head) pair is one thread's whole work: the output is bit for bit the
    same at any thread count."""
    skip_unless_taken(dtype)
    decodes = _case([17, 600, 33, 1], 9, 3, 64, dtype, 5)
    chunks = _chunk_case(CHUNKS, 9, 3, 64, BLOCK_SIZE, 5, dtype)  # tiles are a thread's too
    for q, k_cache, v_cache, table, context in (decodes, chunks):
        outs = []
        for threads in (1, 2, 4):
            scratch = torch.empty(cpu_kernel.scratch_floats(9, 3, int(context.max()), threads))
            outs.append(cpu_kernel.attend(q, k_cache, v_cache, table, context, scratch, threads))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_kernel
def test_a_strided_query_is_read_right() -> None:
    q, k_cache, v_cache, table, context = _case([40, 70], 4, 2, 64, torch.float32, seed=3)
    wide = torch.cat([q, torch.zeros_like(q)], dim=2)[:, :, :64]  # non-contiguous view of q
    scratch = torch.empty(cpu_kernel.scratch_floats(4, 2, 70, 1))
    got = cpu_kernel.attend(wide, k_cache, v_cache, table, context, scratch, 1)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, table, context))


def _backend_step(
    seqs: list[SeqSlice], dtype: torch.dtype, seed: int, hq: int = 6, hkv: int = 2, d: int = 64
) -> torch.Tensor:
    """One layer's attention over a step of `seqs` through the torch backend -> [T, Hq, D]."""
    gen = torch.Generator().manual_seed(seed)
    # drawn at fixed sizes, so that a row's inputs do not depend on the other sequences
    k_cache = torch.randn(16, BLOCK_SIZE, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(16, BLOCK_SIZE, hkv, d, generator=gen).to(dtype)
    num_tokens = sum(s.num_tokens for s in seqs)
    q = torch.randn(MAX_TOKENS, hq, d, generator=gen).to(dtype)[:num_tokens]  # [T, Hq, D]
    k = torch.randn(MAX_TOKENS, hkv, d, generator=gen).to(dtype)[:num_tokens]
    v = torch.randn(MAX_TOKENS, hkv, d, generator=gen).to(dtype)[:num_tokens]
    backend, meta = TorchAttention(), build_metadata(seqs, BLOCK_SIZE, "cpu")
    meta.dtype = dtype  # as StageModel.forward sets it
    backend.prepare(meta, hq, hkv, d)
    return backend.forward(q, k, v, k_cache, v_cache, meta)


MAX_TOKENS = 66

# a first chunk, a later chunk (it sees the cached prefix), decodes, in step order
MIXED = [
    SeqSlice(0, 1, 20, (3, 7)),
    SeqSlice(1, 40, 40, (10, 11, 12)),
    SeqSlice(41, 1, 45, (0, 1, 9)),
    SeqSlice(42, 24, 57, (5, 13, 14, 15)),
]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_is_prepared_for_the_kernel_only_in_a_dtype_it_takes(dtype: torch.dtype) -> None:
    """The model's dtype travels in the metadata: a bf16 step on a CPU whose kernel takes only
    float32 (AVX2 without AVX-512) is prepared for the torch path, not built twice."""
    meta = build_metadata(MIXED, BLOCK_SIZE, "cpu")
    meta.dtype = dtype
    TorchAttention().prepare(meta, 6, 2, 64)
    assert ("cpu_kernel" in meta.extra) is cpu_kernel.takes_dtype(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_whole_step_matches_the_torch_path(dtype: torch.dtype) -> None:
    skip_unless_taken(dtype)
    calls: list[int] = []
    kernel = cpu_kernel.attend

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_kernel, "attend", counted)
        got = _backend_step(MIXED, dtype, seed=1)
    assert calls == [1]  # the whole step in one call
    cpu_kernel.set_enabled(False)
    try:
        want = _backend_step(MIXED, dtype, seed=1)  # SDPA per chunk, paged_decode for decodes
    finally:
        cpu_kernel.set_enabled(True)
    torch.testing.assert_close(got.float(), want.float(), **_tolerance(dtype))  # type: ignore[arg-type]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_decodes_alone_equal_decodes_beside_prompts(dtype: torch.dtype) -> None:
    skip_unless_taken(dtype)
    alone = _backend_step([MIXED[0]], dtype, seed=2)
    mixed = _backend_step(MIXED, dtype, seed=2)
    assert torch.equal(alone[0], mixed[0])
