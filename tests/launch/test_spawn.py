"""`tasks.base.spawn`, the node's rank starter: torchrun's environment for each rank, one failed rank stops the
node, a stop signal stops every rank, and a bad command line is refused naming the flag; on a node without GPUs,
a rank program with a `preload` is imported once and its ranks are forked, each running it as `__main__` as a new
process would. Its ranks here are small Python programs (the training ranks run under it in every launcher test)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tasks.base import spawn
from tests.conftest import ROOT


def _spawn(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tasks.base.spawn", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _rank_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "rank.py"
    script.write_text("import json, os, sys, time\nout = sys.argv[1]\nrank = int(os.environ['RANK'])\n" + body)
    return script


def _rank_program(tmp_path: Path, body: str, forked: bool) -> tuple[list[str], dict[str, str]]:
    """The spawner's target running `body` as each rank, and its environment: a script (a new process per rank),
    or with `forked` a module with a `preload` (forked from the spawner here: no GPU device on the test machine)."""
    if not forked:
        return [str(_rank_script(tmp_path, body))], dict(os.environ)
    main = "import json, os, sys, time\nout = sys.argv[1]\nrank = int(os.environ['RANK'])\n" + body
    (tmp_path / "rankmod.py").write_text("def preload(args):\n    pass\n\n\nif __name__ == '__main__':\n"
                                         + "".join(f"    {line}\n" for line in main.splitlines()))
    return ["-m", "rankmod"], {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}


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


@pytest.mark.parametrize("forked", [False, True], ids=["processes", "forked"])
def test_sigterm_stops_every_rank_even_one_that_ignores_it(tmp_path: Path, forked: bool) -> None:
    target, env = _rank_program(tmp_path, (
        "import signal\n"
        "if rank == 0:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(f'{out}/started-{rank}', 'w').close()\n"
        "time.sleep(600)\n"), forked)
    proc = _spawn("--nproc-per-node=2", "--grace", "1", *target, str(tmp_path), env=env)
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


@pytest.mark.parametrize("forked", [False, True], ids=["processes", "forked"])
def test_a_sigkilled_spawner_takes_its_ranks_with_it(tmp_path: Path, forked: bool) -> None:
    target, env = _rank_program(tmp_path, "open(f'{out}/started-{rank}', 'w').close()\ntime.sleep(600)\n", forked)
    proc = _spawn("--nproc-per-node=2", *target, str(tmp_path), env=env)
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


PROGRAM = '''
import json, os, signal, sys



def preload(args):
    if args == ["--fail-preload"]:
        raise ImportError("no such worker")
    if args == ["--thread"]:
        import threading, time
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        return
    open(os.path.join(os.environ["OUT"], f"preloaded-{os.getpid()}"), "w").close()


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format="OWN %(message)s")  # a rank sets up its own logging
    logging.getLogger("prog").info("configured")
    out = {"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:],
           "pid": os.getpid(), "ppid": os.getppid(), "copies": [m for m in sys.modules if "forkprog" in m],
           "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
           "name": open("/proc/self/comm").read().strip()}
    with open(os.path.join(os.environ["OUT"], "rank" + os.environ["RANK"] + ".json"), "w") as fh:
        json.dump(out, fh)
    if os.environ["RANK"] == "1" and "--raise" in sys.argv:
        raise ValueError("rank one refuses")
'''


def _spawn_forkprog(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "forkprog.py").write_text(PROGRAM)
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    proc = _spawn("--nproc-per-node=2", "-m", "forkprog", *args, env=env)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _ranks(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_are_forked_from_the_spawner_that_preloaded_their_program_once(tmp_path: Path) -> None:
    done = _spawn_forkprog(tmp_path, "--out", "x")
    assert done.returncode == 0, done.stderr
    ranks = _ranks(tmp_path)
    spawner = {r["ppid"] for r in ranks}
    assert len(spawner) == 1 and len({r["pid"] for r in ranks}) == 2
    # Preloaded once, in the spawner (the pid the preload ran in is the ranks' parent), before the fork; each
    # rank runs it as `__main__` beside no second copy of itself, as a new process would.
    assert [p.name for p in tmp_path.glob("preloaded-*")] == [f"preloaded-{pid}" for pid in spawner]
    assert [r["copies"] for r in ranks] == [[], []]
    assert [(r["rank"], r["world"], r["argv"], r["name"]) for r in ranks] == [
        ("0", "2", ["--out", "x"], "rank 0"), ("1", "2", ["--out", "x"], "rank 1")]
    assert all(r["sigterm_default"] for r in ranks)  # not the spawner's stop handler
    assert done.stderr.count("OWN configured") == 2  # each rank's own logging, not the spawner's format


def test_a_forked_ranks_exception_reaches_the_spawners_report(tmp_path: Path) -> None:
    done = _spawn_forkprog(tmp_path, "--raise")
    assert done.returncode == 1
    assert "ValueError: rank one refuses" in done.stderr  # the rank's traceback
    assert "rank 1 exited with code 1 without recording an exception" in done.stderr, done.stderr[-2000:]


def test_a_failed_preload_starts_each_rank_as_a_process_of_its_own(tmp_path: Path) -> None:
    done = _spawn_forkprog(tmp_path, "--fail-preload")
    assert done.returncode == 0, done.stderr
    assert "could not preload the ranks' program (ImportError: no such worker)" in done.stderr
    ranks = _ranks(tmp_path)
    assert list(tmp_path.glob("preloaded-*")) == []
    assert all(r["name"] != f"rank {r['rank']}" for r in ranks)  # run as `-m forkprog` in a new interpreter


def test_a_preload_that_starts_a_thread_starts_each_rank_as_a_process_of_its_own(tmp_path: Path) -> None:
    """A forked copy of a multi-threaded process would hold the other threads' locks forever."""
    done = _spawn_forkprog(tmp_path, "--thread")
    assert done.returncode == 0, done.stderr
    assert "preloading the ranks' program started 1 threads: starting each rank as a new process" in done.stderr
    assert all(r["name"] != f"rank {r['rank']}" for r in _ranks(tmp_path))


def test_no_fork_on_a_node_with_a_gpu_device_or_for_a_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "forkprog.py").write_text(PROGRAM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OUT", str(tmp_path))
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(spawn, "_ACCELERATOR_DEVICES", (str(tmp_path / "nvidia[0-9]*"),))
    assert not spawn.forks_ranks(["-m", "forkprog"])
    assert "forkprog" not in sys.modules  # not even imported
    monkeypatch.setattr(spawn, "_ACCELERATOR_DEVICES", (str(tmp_path / "kfd"),))
    assert not spawn.forks_ranks([str(tmp_path / "forkprog.py")])
    with caplog.at_level(logging.WARNING, logger="tasks.base.spawn"):
        assert not spawn.forks_ranks(["-m", "forkprog", "--fail-preload"])
    assert "could not preload" in caplog.text
    del sys.modules["forkprog"]  # imported by the preload above
