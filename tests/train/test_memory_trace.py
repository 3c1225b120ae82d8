"""A rank's memory trace stays bounded over any run length and always ends at the latest step."""

from __future__ import annotations

from tasks.train.memory_trace import MAX_POINTS, MemoryTrace, rss_now


def test_a_long_runs_trace_is_bounded_evenly_strided_and_ends_at_the_last_step() -> None:
    trace = MemoryTrace()
    for step in range(1, 1001):
        trace.record(step)
    points = trace.points()
    steps = [p[0] for p in points]
    assert len(points) <= MAX_POINTS and steps[-1] == 1000
    assert steps == list(range(4, 1001, 4))  # the stride doubled twice: 250 points
    # A save every 10 steps from step 1 to 300: every saving step is still there.
    short = MemoryTrace()
    for step in range(1, 301):
        short.record(step)
    assert {p[0] for p in short.points()} >= set(range(10, 301, 10)) and len(short.points()) <= MAX_POINTS


def test_a_resumed_runs_trace_starts_at_its_first_step_and_holds_rss_in_bytes() -> None:
    trace = MemoryTrace(max_points=8)
    for step in range(31, 38):
        trace.record(step)
    assert [p[0] for p in trace.points()] == list(range(31, 38))
    rss, anon = rss_now()
    assert rss is not None and anon is not None and 0 < anon <= rss
    # Bytes, not KiB: the same figure psutil reads from /proc/self/statm (the kernel's RSS counters are updated in
    # batches, so a fresh allocation's growth is not a reliable unit check).
    import psutil

    trace.record(38)
    step, rss_after, anon_after = trace.points()[-1]
    assert rss_after >= anon_after
    assert step == 38 and 0.75 <= rss_after / psutil.Process().memory_info().rss <= 1.25, rss_after
