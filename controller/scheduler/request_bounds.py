"""Every bound on a request's fields, in one place.

SamplingParams (sequence.py) checks the sampling fields against these, and the checks both
public APIs share (controller/api_request.py) the rest; the OpenAI bodies' types
(controller/openai_api/bodies.py) hold no bound of their own. So a request is refused for the
same reason, naming the same field, whichever API it came through. Every float is bounded on
both sides, which also refuses NaN and infinity: JSON's 1e400 and gRPC's float both reach here
as infinity, and a temperature of infinity divides the grammar mask's -inf logits into NaN.
Pure (the scheduler core imports it).
"""

from __future__ import annotations

from controller.scheduler.errors import InvalidRequestError

MAX_N = 128
"""Most sequences one request may run: n, and best_of (OpenAI's limit)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask for, per token or per prompt token (OpenAI's, vLLM's)."""
MAX_LOGIT_BIAS_TOKENS = 300
"""Most tokens one request may bias (OpenAI's limit)."""
MAX_ABS_LOGIT_BIAS = 100.0
"""A bias is in [-100, 100] (OpenAI's): -100 bans a token, 100 all but forces it."""
MAX_TEMPERATURE = 2.0
"""Temperature is in [0, 2]; 0 is greedy. OpenAI's and vLLM's bound, so a request one of them
accepts is accepted here, and one they refuse is refused for the same reason."""
MAX_ABS_PENALTY = 2.0
"""presence_penalty and frequency_penalty are in [-2, 2] (OpenAI's)."""
MAX_REPETITION_PENALTY = 2.0
"""repetition_penalty is in (0, 2]; 1 is off. Our bound, the same as the other penalties' (vLLM
asks only that it be above 0 and finite); the values used in practice are 1 to 1.5."""
MAX_TOP_K = 2**31 - 1
"""The workers' plans carry top_k as an int32 (0 disables it)."""
SEED_END = 2**64
"""Seeds are in [0, 2**64): the workers' generators take 64 bits."""


def check_in(field: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    """Raises InvalidRequestError naming field unless value is in [low, high] ((low, high] with
    low_open); NaN is never in."""
    inside = (low < value if low_open else low <= value) and value <= high
    if not inside:
        opening = "(" if low_open else "["
        raise InvalidRequestError(
            field, f"must be in {opening}{_shown(low)}, {_shown(high)}], got {value}"
        )


def _shown(bound: float) -> str:
    """2 for 2.0, 2147483647 for 2**31 - 1: as a client would write the bound."""
    return str(int(bound)) if float(bound).is_integer() else str(bound)
