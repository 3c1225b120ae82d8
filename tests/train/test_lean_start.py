"""The ranks' AdamW: torch's numbers, bit for bit, without importing the compiler (issue 27: ~1.7 s per rank).

Run in a fresh interpreter: the test process itself may already hold `torch._dynamo`."""

from __future__ import annotations

import json
import subprocess
import sys

from tasks import REPO_ROOT as ROOT

_SCRIPT = r"""
import json, sys
import torch
from tasks.train.lean_start import eager_adamw

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

def train(make, steps, state=None):
    net = model()
    opt = make(net.parameters())
    if state is not None:
        opt.load_state_dict(state)
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
    return net, opt

ours = lambda params: eager_adamw(params, lr=1e-2, weight_decay=0.1)
net, opt = train(ours, 5)
# a resume: 3 steps, the optimizer's state through state_dict/load_state_dict into a new one, 2 more
first, saved = train(ours, 3)
state = saved.state_dict()
resumed = model()
resumed.load_state_dict(first.state_dict())
opt2 = ours(resumed.parameters())
opt2.load_state_dict(state)
torch.manual_seed(1)
for _ in range(3):
    torch.randn(8, 16)
for _ in range(2):
    opt2.zero_grad()
    resumed(torch.randn(8, 16)).pow(2).mean().backward()
    opt2.step()
dynamo = "torch._dynamo" in sys.modules
ref, _ = train(lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), 5)
print(json.dumps({
    "dynamo_imported": dynamo,
    "equal": all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters())),
    "resumed_equal": all(torch.equal(a, b) for a, b in zip(resumed.parameters(), ref.parameters())),
    "state_keys": sorted(state["state"][0]),
}))
"""


def test_eager_adamw_is_torchs_adamw_bit_for_bit_and_never_imports_the_compiler() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"dynamo_imported": False, "equal": True, "resumed_equal": True,
                   "state_keys": ["exp_avg", "exp_avg_sq", "step"]}


def test_a_rank_program_starts_with_deepspeed_but_without_mlflow() -> None:
    """Every rank program goes through `tasks.train.start`: DeepSpeed is imported with the accelerator named and
    without the MLflow its autotuner would import (2.9 s and ~100 MiB per rank, found as a LoRA rank 100 MiB over
    its plan), and MLflow still imports afterwards for rank 0's tracker; the program gets its own arguments. Neither
    worker loads the registry's database layer (sqlalchemy, ~0.25 s a rank: the evaluation worker did, through the
    weights fetcher's import of `Registry`)."""
    done = subprocess.run([sys.executable, "-m", "tasks.train.start", "tests.train.start_probe", "--flag", "x"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["deepspeed"] and not seen["mlflow"] and not seen["sqlalchemy"], seen
    assert seen["mlflow_after"] == "mlflow" and seen["accelerator"] == "cpu"
    assert seen["argv"][1:] == ["--flag", "x"] and seen["argv"][0].endswith("start_probe.py")
    assert "Setting accelerator" not in done.stderr + done.stdout
