"""`tasks.base.spawn`, the node's rank starter: torchrun's environment for each rank, one failed rank stops the
node, a stop signal stops every rank, and a bad command line is refused naming the flag. Its ranks here are
small Python programs (the training ranks run under it in every launcher test)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import ROOT


def _spawn(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tasks.base.spawn", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _rank_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "rank.py"
    script.write_text("import json, os, sys, time\nout = sys.argv[1]\nrank = int(os.environ['RANK'])\n" + body)
    return script


def test_each_rank_gets_torchruns_environment_on_its_node(tmp_path: Path) -> None:
    script = _rank_script(tmp_path, "json.dump(dict(os.environ), open(f'{out}/{rank}.json', 'w'))\n")
    proc = _spawn("--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--master-addr=10.0.0.1",
                  "--master-port=29999", str(script), str(tmp_path))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["2.json", "3.json"]  # node 1 holds ranks 2 and 3
    for rank, local in ((2, 0), (3, 1)):
        env = json.loads((tmp_path / f"{rank}.json").read_text())
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                    "MASTER_ADDR", "MASTER_PORT")} == {
            "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29999"}


def test_a_failed_rank_stops_the_others_and_fails_the_node_naming_it(tmp_path: Path) -> None:
    script = _rank_script(tmp_path, (
        "open(f'{out}/started-{rank}', 'w').close()\n"
        "if rank == 1:\n    sys.exit(3)\n"
        "time.sleep(600)\n"))
    started = time.monotonic()
    proc = _spawn("--nproc-per-node=3", str(script), str(tmp_path))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "rank 1 exited with code 3 without recording an exception" in err
    assert time.monotonic() - started < 60  # the sleeping ranks were stopped, not waited for


def test_the_first_failure_by_time_is_reported_with_its_exception_not_the_lowest_rank(tmp_path: Path) -> None:
    """Rank 2 raises (and records, as every rank program's entry point does); rank 0 dies of it afterwards
    (here: of the SIGTERM that stops it, as a rank in a broken collective would). The node reports rank 2
    as the cause, at once, then rank 0; rank 1, stopped without an exception, is no failure of its own."""
    from tasks.base.rank_failure import LINE_PREFIX

    script = _rank_script(tmp_path, (
        "import signal\n"
        "from tasks.base.rank_failure import record\n"
        "def peer_gone(signum, frame):\n    raise RuntimeError('Connection closed by peer')\n"
        "if rank == 0:\n    signal.signal(signal.SIGTERM, peer_gone)\n"
        "open(f'{out}/started-{rank}', 'w').close()\n"
        "try:\n"
        "    while rank == 2 and len([n for n in os.listdir(out) if n.startswith('started-')]) < 3:\n"
        "        time.sleep(0.01)\n"
        "    if rank == 2:\n"
        "        {'shard': 7}['shard-00007']\n"
        "    time.sleep(600)\n"
        "except Exception as exc:\n"
        "    record(exc)\n"
        "    sys.exit(1)\n"))
    line = script.read_text().splitlines().index("        {'shard': 7}['shard-00007']") + 1
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = _spawn("--nproc-per-node=3", str(script), str(tmp_path), env={**os.environ, "TMPDIR": str(scratch)})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    reports = [json.loads(text[len(LINE_PREFIX):]) for text in out.splitlines() if text.startswith(LINE_PREFIX)]
    assert [(r["rank"], r["type"], r["message"], r["exit_code"]) for r in reports] == [
        (2, "KeyError", "'shard-00007'", 1), (0, "RuntimeError", "Connection closed by peer", 1)]
    assert reports[0]["where"] == f"{script}:{line}" and "Traceback" in reports[0]["traceback"]
    logged = err.splitlines()
    assert logged[0] == (f"ERROR tasks.base.spawn: rank 2 failed: KeyError: 'shard-00007' ({script}:{line} on "
                         f"{reports[0]['host']}); stopping this node's other ranks")
    assert logged[1].startswith("WARNING tasks.base.spawn: then rank 0 failed: RuntimeError: Connection closed by peer")
    assert "rank 1" not in err and "Traceback" not in err  # the ranks' tracebacks travel in the reports
    assert list(scratch.iterdir()) == []  # the ranks' error files went with the spawner


def test_sigterm_stops_every_rank_even_one_that_ignores_it(tmp_path: Path) -> None:
    script = _rank_script(tmp_path, (
        "import signal\n"
        "if rank == 0:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(f'{out}/started-{rank}', 'w').close()\n"
        "time.sleep(600)\n"))
    proc = _spawn("--nproc-per-node=2", "--grace", "1", str(script), str(tmp_path))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started-*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    ranks = psutil.Process(proc.pid).children()
    assert len(ranks) == 2
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not [r for r in ranks if r.is_running() and r.status() != psutil.STATUS_ZOMBIE]


def test_a_sigkilled_spawner_takes_its_ranks_with_it(tmp_path: Path) -> None:
    script = _rank_script(tmp_path, "open(f'{out}/started-{rank}', 'w').close()\ntime.sleep(600)\n")
    proc = _spawn("--nproc-per-node=2", str(script), str(tmp_path))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started-*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    ranks = psutil.Process(proc.pid).children()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive


def test_a_node_that_does_not_exist_is_refused_naming_the_flags(tmp_path: Path) -> None:
    proc = _spawn("--nnodes=2", "--node-rank=2", "--nproc-per-node=1", "-m", "json.tool")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--node-rank 2 of --nnodes 2" in err
    proc = _spawn("--nproc-per-node=1")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "module (-m MODULE) or script is missing" in err
