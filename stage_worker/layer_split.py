"""How many decoder layers each pipeline stage holds.

Stages run one after the other on every micro-batch, so the pipeline moves at the pace of its
slowest stage. An even split of the layers leaves the last stage the slowest: it also runs the
LM head, which reads vocab x hidden weights every step. For a large model that is under half a
layer (Falcon-180B: 0.97 B parameters against 2.2 B a layer), for a small one it is many
(SmolLM2-135M: 28 M against 3.5 M, 8 layers' worth of bytes). The default split gives the last
stage fewer layers so that the stages' decode work is as even as whole layers allow.

A layer's decode time is its linear layers (weight bytes) plus attention and some 40 small ops;
the head is one matrix. So the head is priced as its parameters over a layer's linear
parameters, times HEAD_COST_PER_LAYER_BYTES: what a layer's worth of head bytes costs against a
whole layer's time, measured with `sarathictl bench step-breakdown` on the demo model (linear
layers are 63-69% of a layer's time at batches 1-32, and the head reads its bytes at 84-95% of
the layers' per-byte time: about 0.6). A fixed split (`--layer-split`) overrides the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from stage_worker.errors import CheckpointError

if TYPE_CHECKING:  # config.py imports this module
    from stage_worker.config import ModelSpec

HEAD_COST_PER_LAYER_BYTES = 0.6
"""A layer's worth of LM-head weights costs this share of a whole layer's decode time."""


def layer_linear_params(spec: ModelSpec) -> int:
    """Parameters of one decoder layer's linear layers (attention and MLP, no norms)."""
    h, hd = spec.hidden_size, spec.head_dim
    attention = h * spec.num_heads * hd * 2 + h * spec.num_kv_heads * hd * 2  # q, o; k, v
    mlp_matrices = 3 if spec.family == "llama" else 2  # gate, up, down / up, down
    return attention + mlp_matrices * h * spec.ffn_size


def head_cost_in_layers(spec: ModelSpec) -> float:
    """The LM head's decode time in layers' worth (see the module's docstring)."""
    head = spec.vocab_size * spec.hidden_size
    return head / layer_linear_params(spec) * HEAD_COST_PER_LAYER_BYTES


def balanced_split(num_layers: int, pp: int, last_stage_extra: float) -> tuple[int, ...]:
    """Layers per stage, stage 0 first, minimizing the slowest stage's cost in layers when the
    last stage also carries `last_stage_extra` layers' worth of work. The other stages share
    the rest evenly (earlier stages take the remainder); ties go to the more even split."""
    if pp < 1 or num_layers < pp:
        raise CheckpointError(f"config.json: num_hidden_layers={num_layers} is fewer than pp={pp}")
    if pp == 1:
        return (num_layers,)

    def slowest(last: int) -> float:
        others = -(-(num_layers - last) // (pp - 1))  # ceil
        return max(float(others), last + last_stage_extra)

    even = num_layers // pp
    candidates = range(1, num_layers - (pp - 1) + 1)
    last = min(candidates, key=lambda n: (slowest(n), abs(n - even)))
    rest, extra = divmod(num_layers - last, pp - 1)
    return (*(rest + (1 if s < extra else 0) for s in range(pp - 1)), last)


def default_split(spec: ModelSpec, pp: int) -> tuple[int, ...]:
    return balanced_split(spec.num_layers, pp, head_cost_in_layers(spec))


def check_split(split: Sequence[int], spec: ModelSpec, pp: int) -> tuple[int, ...]:
    """A given split, refused (naming --layer-split) unless it has pp stages of at least one
    layer that add up to the model's layers."""
    split = tuple(split)
    if len(split) != pp or any(n < 1 for n in split) or sum(split) != spec.num_layers:
        raise CheckpointError(
            f"--layer-split {','.join(map(str, split))}: need {pp} counts of at least 1 layer "
            f"adding up to num_hidden_layers={spec.num_layers}"
        )
    return split


def stage_layers(spec: ModelSpec, pp: int, stage: int, split: Sequence[int] = ()) -> range:
    """The layers `stage` holds: from `split` when given, else from the default split."""
    counts = check_split(split, spec, pp) if split else default_split(spec, pp)
    first = sum(counts[:stage])
    return range(first, first + counts[stage])
