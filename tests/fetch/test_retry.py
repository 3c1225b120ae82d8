"""with_retries: transient failures are retried with backoff and reported; permanent ones are not retried."""

from __future__ import annotations

import pytest

from tasks.fetch import retry
from tasks.fetch.retry import ATTEMPTS, with_retries


def _flaky(failures: list[BaseException]):
    calls = []

    def fn() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return "ok"

    return fn, calls


def test_transient_failures_are_retried_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "FIRST_BACKOFF_S", 0.0)
    fn, calls = _flaky([ConnectionResetError("reset"), TimeoutError("slow")])
    seen: list[tuple[int, str]] = []
    assert with_retries(fn, lambda n, exc: seen.append((n, str(exc)))) == "ok"
    assert len(calls) == 3
    assert seen == [(1, "reset"), (2, "slow")]


def test_a_missing_object_is_not_retried() -> None:
    fn, calls = _flaky([FileNotFoundError("gone")])
    with pytest.raises(FileNotFoundError):
        with_retries(fn, lambda n, exc: pytest.fail("no retry expected"))
    assert len(calls) == 1


def test_gives_up_after_the_last_attempt_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "FIRST_BACKOFF_S", 0.0)
    fn, calls = _flaky([OSError(f"down {i}") for i in range(ATTEMPTS + 5)])
    seen: list[int] = []
    with pytest.raises(OSError, match=f"down {ATTEMPTS - 1}"):
        with_retries(fn, lambda n, exc: seen.append(n))
    assert len(calls) == ATTEMPTS
    assert seen == list(range(1, ATTEMPTS))
