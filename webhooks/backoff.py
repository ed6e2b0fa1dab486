"""When to try a failed delivery again: exponential backoff with full jitter (a uniform wait
between 0 and `base * 2^(attempt-1)`, capped), so endpoints recovering from an outage are not
hit by every sender at once; and for how long (the retry window)."""

from __future__ import annotations

import random
from collections.abc import Callable


def delay(attempt: int, base: float, cap: float, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait after the `attempt`-th failed attempt (1, 2, …) before the next one."""
    if attempt < 1:
        raise ValueError("attempts count from 1")
    ceiling = min(cap, base * 2 ** min(attempt - 1, 62))
    return float(ceiling * rng())


def next_attempt_in(
    attempt: int,
    elapsed: float,
    window: float,
    base: float,
    cap: float,
    rng: Callable[[], float] = random.random,
) -> float | None:
    """The wait before the next attempt after `attempt` failures, `elapsed` seconds after the
    first attempt; None when that next attempt would fall outside the retry `window` (the
    delivery then goes to the dead letters)."""
    wait = delay(attempt, base, cap, rng)
    return None if elapsed + wait > window else wait
