"""A rank's failure record (tasks/base/rank_failure.py): what a rank writes, the one line its spawner prints, what the
launcher's log sink keeps. The processes that carry it (spawn, every launcher) are tested in their own files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tasks.base.rank_failure import ERROR_FILE_VAR, LINE_BYTES, LINE_PREFIX, RankFailure, read, record, unrecorded
from tasks.launch.logs import LineSink

HERE = Path(__file__).relative_to(Path(__file__).parents[2])


def _look_up_a_token_past_the_vocabulary() -> None:
    torch.nn.functional.embedding(torch.tensor([300]), torch.zeros(256, 4))  # raises inside torch


def test_a_recorded_exception_names_the_line_of_our_code_not_the_librarys(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv(ERROR_FILE_VAR, raising=False)
    try:
        _look_up_a_token_past_the_vocabulary()
    except IndexError as exc:
        assert not record(exc)  # not under tasks.base.spawn: the caller prints it as usual
        monkeypatch.setenv(ERROR_FILE_VAR, str(tmp_path / "rank-3.json"))
        assert record(exc)
    failure = read(tmp_path / "rank-3.json", 1)
    assert failure is not None and (failure.rank, failure.type, failure.exit_code) == (3, "IndexError", 1)
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "raises inside torch" in text)
    assert failure.where == f"{HERE}:{line}"  # torch's own frames (site-packages) are skipped
    assert "torch/nn/functional.py" in failure.traceback and failure.traceback.endswith(
        "IndexError: index out of range in self\n")
    assert failure.describe() == (f"rank 3 failed: IndexError: index out of range in self ({HERE}:{line} on "
                                  f"{failure.host})")
    assert read(tmp_path / "rank-4.json", 1) is None  # a rank that recorded nothing


def test_a_message_stays_one_short_line_and_a_signal_is_named(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ERROR_FILE_VAR, str(tmp_path / "rank-0.json"))
    try:
        raise ValueError("cannot mmap an empty file\n  shard: train/shard-00000.bin\n" + "x" * 2000)
    except ValueError as exc:
        record(exc)
    failure = read(tmp_path / "rank-0.json", 1)
    assert failure is not None and "\n" not in failure.message and len(failure.message) == 500
    assert failure.message.startswith("cannot mmap an empty file shard: train/shard-00000.bin xxx")
    assert failure.message.endswith("x...")
    killed = unrecorded(5, -9)
    assert killed.describe() == f"rank 5 was killed by SIGKILL (on {killed.host})"
    assert RankFailure(rank=1, at=0.0, exit_code=3).describe() == (
        "rank 1 exited with code 3 without recording an exception")


def test_the_line_fits_one_pipe_write_keeping_the_innermost_frames() -> None:
    """A deep traceback (and a message in any script) still makes one line a pipe writes whole: the
    oldest frames are cut, the innermost ones and the exception stay."""
    frames = "".join(f'  File "/srv/pkg/m{i}.py", line {i}, in f{i}\n    g{i}()\n' for i in range(400))
    failure = RankFailure(rank=2, at=1.0, host="gpu-07", type="KeyError", message="'données'", where="tasks/x.py:9",
                          traceback=f"Traceback (most recent call last):\n{frames}KeyError: 'données'\n", exit_code=1)
    line = failure.line()
    assert line.startswith(LINE_PREFIX) and "\n" not in line and len(line.encode()) <= LINE_BYTES
    back = RankFailure.from_dict(json.loads(line[len(LINE_PREFIX):]))
    assert back is not None and back.traceback.startswith("...\n")
    assert back.traceback.endswith("in f399\n    g399()\nKeyError: 'données'\n")
    assert back.describe() == "rank 2 failed: KeyError: 'données' (tasks/x.py:9 on gpu-07)"


def test_the_sink_keeps_the_earliest_failure_and_logs_the_lines_around_it(caplog: pytest.LogCaptureFixture) -> None:
    """Spawners on several nodes report: the first failure by time is the cause, whatever its rank or the
    order the lines arrive in. The reports are not log lines; a torn one is logged as text, never lost."""
    sink = LineSink(logging.getLogger("tests.ranks"), prefix="[node] ")
    later = RankFailure(rank=0, at=20.0, type="RuntimeError", message="Connection closed by peer", exit_code=1)
    cause = RankFailure(rank=3, at=10.0, type="IndexError", message="index out of range in self", exit_code=1)
    with caplog.at_level(logging.INFO, logger="tests.ranks"):
        sink(later.line() + "\n")
        sink("INFO [rank 1] tasks.train.worker: still going\n")
        sink(cause.line() + "\n")
        sink(LINE_PREFIX + '{"rank": 1, "at": 5.0, "ty\n')
        sink(RankFailure(rank=1, at=30.0, exit_code=-15).line())
    assert sink.rank_failure == cause
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["[node] [rank 1] tasks.train.worker: still going",
                        f'[node] {LINE_PREFIX}{{"rank": 1, "at": 5.0, "ty']
