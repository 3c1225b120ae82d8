"""One rank's export, alone in its process, as a training rank runs it: stream the stage's files into a local
store's staging area, then report the peak RSS the export added (`/proc/self/clear_refs` resets the peak
after the model exists), the files' reports, and whether the database layer (sqlalchemy) was ever
imported. Run by tests/train/test_export.py."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--staging", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True, help="the model section, as JSON")
    args = parser.parse_args()

    import torch

    from tasks.config.model import ModelConfig
    from tasks.models import get_family
    from tasks.models.parallel import TPGroup
    from tasks.train.export import export_stage
    from tasks.train.worker import Trainer  # noqa: F401 -- what a rank has imported before it exports

    torch.set_num_threads(1)
    m = ModelConfig.model_validate(json.loads(args.model))
    module = get_family(m.family).Reference(m, seed=0)
    held = sum(p.numel() * p.element_size() for p in module.parameters())
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak: only the export counts from here
    before = _kib("VmRSS")
    reports = export_stage(module, m, TPGroup(), output_dir=args.out, tag="step-1",
                           spec={"store_url": args.store, "storage_options": {}, "staging": args.staging,
                                 "dtype": "bf16"})
    peak = _kib("VmHWM")
    print(json.dumps({"reports": reports, "held_bytes": held,
                      "peak_added_bytes": (peak - before) * 1024, "sqlalchemy": "sqlalchemy" in sys.modules}))


if __name__ == "__main__":
    main()
