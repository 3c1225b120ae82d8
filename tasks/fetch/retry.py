"""Bounded retries with backoff for reads from the object store.

The first try runs bare and tenacity is imported only after a failure: a no-op re-warm never
loads it, and 5,000 small objects do not pay its per-attempt machinery (~16 us each).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from tasks.base.errors import InvalidInputError

T = TypeVar("T")

ATTEMPTS = 4
FIRST_BACKOFF_S = 0.5


def retryable(exc: BaseException) -> bool:
    """Retry transient failures; a missing object, a local permission problem or bad input will not go away."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                        InvalidInputError)):
        return False
    return isinstance(exc, Exception)


def with_retries(fn: Callable[[], T], on_retry: Callable[[int, BaseException], None]) -> T:
    """fn() up to ATTEMPTS times, backing off 0.5, 1, 2 s; `on_retry(failed_attempt, exc)` before each wait.

    An outage of a few seconds passes unnoticed; a non-retryable error or the last failure propagates.
    """
    try:
        return fn()
    except Exception as exc:
        if not retryable(exc):
            raise
        on_retry(1, exc)
    from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

    def before_sleep(state: RetryCallState) -> None:  # attempt numbers count the bare first try too
        exc = state.outcome.exception() if state.outcome else None
        on_retry(state.attempt_number + 1, exc or RuntimeError("unknown failure"))

    time.sleep(FIRST_BACKOFF_S)
    return Retrying(stop=stop_after_attempt(ATTEMPTS - 1), wait=wait_exponential(multiplier=1, min=1, max=4),
                    retry=retry_if_exception(retryable), reraise=True, before_sleep=before_sleep)(fn)
