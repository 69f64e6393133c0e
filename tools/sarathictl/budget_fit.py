"""The token budget of one stage on every core (PP=1), fitted to this machine from what
`sarathictl tune-layout` measured there: a lone request's first token and its pace after it.

Why: the budget trades two things. A step carries a fixed cost whatever it holds (the weights
read once, the LM head, the layers' dispatch), so small chunks pay it many times over a prompt
and lose throughput; a step of many prompt tokens makes every running decode wait that long for
its next token. The constant budget up ran before (64) was measured on the AVX2 EPYC, where a
64-token chunk took 150 ms; on a Zen 5 EPYC in bf16 the same chunk takes 32 ms, and budget 128
served 1.11x the requests at saturation while its P99 TBT stayed inside the strict SLO
(BENCHMARKS.md, session 26). The machine's own costs should set it.

The rule: the largest budget whose step, predicted from the lone request, takes at most
STRICT_TBT_MULTIPLE times a lone decode step, so that a decode riding with a full chunk waits
no longer than a strict TBT SLO allows. The unit is our own lone decode step, the one this
machine's figures give; `make bench-vs-vllm` sets its strict SLO at 5x vLLM's median TBT at
0.25 req/s, a lightly loaded decode step of about the same size. The paper's is 5x a decode
step of a batch of 32, which on a CPU is about 3x a lone one: looser, and a larger budget.

What the line leaves out, all of it on the side of smaller budgets: the 256-token step's
attention grows with the square of its length and the request's own overhead rides in the
TTFT, so both count as cost per token and a short chunk is predicted dearer than it is (on the
Zen 1 EPYC's figures, 219 ms for 64 tokens, where 150 was measured in session 12); and the
decodes that ride in a step are counted only as tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STRICT_TBT_MULTIPLE = 5.0
"""A step carrying a full chunk may take this many times a lone decode step (the strict TBT SLO
of `make bench-vs-vllm`)."""

BUDGET_CHOICES = (32, 64, 128, 256, 512)
"""The budgets the rule picks from: multiples of the scheduler's default 32-token tile, at most
up's idle budget (512), which the budget may not exceed."""


@dataclass(frozen=True)
class StepFit:
    """A step's time in ms, linear in the tokens it carries: fixed_ms + per_token_ms * tokens."""

    fixed_ms: float
    per_token_ms: float

    def step_ms(self, tokens: int) -> float:
        return self.fixed_ms + self.per_token_ms * tokens


def fit_steps(
    lone_ttft_ms: float, lone_tpot_ms: float, prompt_tokens: int, chunk_tokens: int
) -> StepFit | None:
    """The line through a lone request's two figures: its prompt went in ceil(prompt_tokens /
    chunk_tokens) steps (TTFT), each of its decodes in one step of one token (TPOT). None
    where the figures admit no line with a positive cost per token (too short a prompt, or a
    TTFT no longer than its steps' decodes: noise, not a measurement to fit)."""
    if prompt_tokens < 1 or chunk_tokens < 1:
        return None
    steps = math.ceil(prompt_tokens / chunk_tokens)
    if prompt_tokens <= steps:
        return None
    # TTFT = steps * fixed + prompt_tokens * per_token; TPOT = fixed + per_token.
    per_token_ms = (lone_ttft_ms - steps * lone_tpot_ms) / (prompt_tokens - steps)
    fixed_ms = lone_tpot_ms - per_token_ms
    if per_token_ms <= 0 or fixed_ms < 0:
        return None
    return StepFit(fixed_ms, per_token_ms)


def fitted_budget(fit: StepFit) -> int:
    """The largest of BUDGET_CHOICES whose step takes at most STRICT_TBT_MULTIPLE decode steps;
    the smallest choice where none does (the tile: a prompt must move)."""
    limit_ms = STRICT_TBT_MULTIPLE * fit.step_ms(1)
    fitting = [b for b in BUDGET_CHOICES if fit.step_ms(b) <= limit_ms]
    return max(fitting, default=BUDGET_CHOICES[0])
