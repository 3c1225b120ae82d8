"""Durations in a job config: written as people write them (3600, 36h, 1d12h, PT36H), said as people say them."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator, TypeAdapter, ValidationError

_COMPACT_DURATION = re.compile(r"^(?=\d)(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
_TIMEDELTA: TypeAdapter[timedelta] = TypeAdapter(timedelta)
DURATION_HELP = "seconds (3600), d/h/m/s parts (2d, 36h, 1d12h, 90m) or ISO 8601 (P2D, PT36H)"


def _duration(value: Any) -> Any:
    """A duration as people write it: the compact d/h/m/s form here, numbers and ISO 8601 by pydantic."""
    if isinstance(value, str) and (m := _COMPACT_DURATION.fullmatch(value.strip())):
        days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
        try:
            return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        except OverflowError:
            raise ValueError(f"{value!r} is longer than a duration can be") from None
    if isinstance(value, str | int | float | timedelta) and not isinstance(value, bool):
        try:
            return _TIMEDELTA.validate_python(value)
        except ValidationError:
            pass
    raise ValueError(f"not a duration ({value!r}): use {DURATION_HELP}")


Duration = Annotated[timedelta, BeforeValidator(_duration)]


def format_duration(value: timedelta | float) -> str:
    """A duration (or seconds) as people say it: "1 day", "1 day 12 hours", "1 minute 30 seconds", never
    timedelta's "1 day, 0:00:00". Rounded to whole seconds."""
    seconds = round(value.total_seconds() if isinstance(value, timedelta) else value)
    if seconds <= 0:
        return "0 seconds"
    parts = []
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count} {unit}" + ("s" if count != 1 else ""))
    return " ".join(parts)
