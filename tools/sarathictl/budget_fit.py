"""The token budget `up --local` runs, fitted to this machine from what `sarathictl tune-layout`
measured there: a lone request's first token and its pace after it.

Why: the budget trades two things. A step carries a fixed cost whatever it holds (the weights
read once, the LM head, the layers' dispatch), so small chunks pay it many times over a prompt
and lose throughput; a step of many prompt tokens makes every running decode wait that long for
its next token. The paper (section 4.3) derives the budget from the TBT SLO: the largest whose
step keeps the decodes riding with it within it.

The rule: the SLO is the paper's strict one (slo_rule.py), 5x a decode step of a batch of 32,
predicted from the line through the lone request's figures; the budget is the largest multiple
of the 32-token tile whose step, PP of them one after another, times P99_GAP_OVER_STEP stays
within that SLO.

Why not our own lone decode step as the unit (the rule of sessions 27-28, 5x of it): every
speed-up of our decode then shrank the budget and cost throughput (on the Zen 5 EPYC in bf16,
budget 64 where 128 to 192 served 6-17% more requests within the same SLO). A batch of 32 is
the paper's unit and the planner's (`sarathictl plan --tbt-slo strict`): one target for every
command. Its step is about twice a lone decode step on the Zen 5 EPYC in bf16 (six times on the
Zen 1 EPYC in float32). In the line's terms the budget is
the largest choice up to 2.33 * fixed / per_token + 106 at PP=1 and 0.67 * fixed / per_token +
53 at PP=2 (at least 96 and 32), so some budget always fits at the depths tune-layout runs.

What the line leaves out: the 256-token step's attention grows with the square of its length
and the request's own overhead rides in the TTFT, so both count as cost per token: a short
chunk is predicted dearer than it is (on the Zen 1 EPYC's figures, 219 ms for 64 tokens, where
150 was measured in session 12), and a decode's cost is predicted as a prompt token's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sarathictl.slo_rule import SLO_BATCH, SLO_FACTORS

TILE_TOKENS = 32
"""The scheduler's default matmul tile: every budget is a multiple of it."""

P99_GAP_OVER_STEP = 1.5
"""A decode's P99 gap between tokens over the predicted step of a full budget, as the client
measures it: on the Zen 5 EPYC in bf16, below saturation, 1.14x-1.53x at budgets 64 to 256
(BENCHMARKS.md, session 29; at most 1.41x from 96, the least the rule picks at PP=1): 10-15 ms
over the step whatever the budget (the controller and the HTTP server share the cores with
the worker), so a ratio is cautious at large budgets (about 1.25x at 160). The controller's
SLO mode allows 1.25x (controller/slo.py: DEFAULT_HEADROOM), enough for a GPU's steadier
steps, not for these."""

BUDGET_CHOICES = tuple(range(TILE_TOKENS, 512 + 1, TILE_TOKENS))
"""The budgets the rule picks from: every multiple of the tile up to up's idle budget (512),
which the budget may not exceed."""


@dataclass(frozen=True)
class StepFit:
    """A step's time in ms, linear in the tokens it carries: fixed_ms + per_token_ms * tokens."""

    fixed_ms: float
    per_token_ms: float

    def step_ms(self, tokens: int) -> float:
        return self.fixed_ms + self.per_token_ms * tokens

    def strict_tbt_slo_ms(self) -> float:
        """The paper's strict SLO on this machine: 5x a decode step of a batch of 32."""
        return SLO_FACTORS["strict"] * self.step_ms(SLO_BATCH)

    def stage_limit_ms(self, pp: int) -> float:
        """The longest a full step of one stage may take: a decode's next token waits for all
        PP stages' steps, each about as long as the one stage's at the same budget (a stage
        holds 1/PP of the layers on 1/PP of the cores), and the P99 gap exceeds the step."""
        return self.strict_tbt_slo_ms() / P99_GAP_OVER_STEP / pp


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


def fitted_budget(fit: StepFit, pp: int = 1) -> int:
    """The largest of BUDGET_CHOICES whose step fits fit.stage_limit_ms(pp); the smallest
    choice where none does (the tile: a prompt must move)."""
    limit_ms = fit.stage_limit_ms(pp)
    fitting = [b for b in BUDGET_CHOICES if fit.step_ms(b) <= limit_ms]
    return max(fitting, default=BUDGET_CHOICES[0])
