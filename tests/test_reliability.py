"""Nothing lost, ever: concurrent runs, interrupted training, damaged checkpoints, write failures.

Each test checks the exit code, that there is exactly one line to read, that nothing half-made is left and
that nothing that was there before is lost."""

import json
import os
import subprocess
import sys
from pathlib import Path

from unet.cli import PARTIAL
from unet.cli.folders import publish

ROOT = Path(__file__).resolve().parents[1]


def one_line(err: str, message: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    return lines[0]


# --- 1. two runs into the same --out
def test_publish_never_replaces_a_result_it_did_not_make(tmp_path):
    finals = []
    for k in range(3):
        tmp = tmp_path / f"{PARTIAL}{os.getpid()}-{k}"
        tmp.mkdir()
        (tmp / "meta.json").write_text(str(k))
        finals.append(publish(tmp, tmp_path / "a-red-circle-s0"))
    assert [f.name for f in finals] == ["a-red-circle-s0", "a-red-circle-s0-2", "a-red-circle-s0-3"]
    assert [(f / "meta.json").read_text() for f in finals] == ["0", "1", "2"]


def test_two_generate_processes_into_one_out_both_survive(tiny_pipeline_dir, tmp_path):
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "generate.py"), "a red circle", "--model",
                               str(tiny_pipeline_dir), "--out", str(out), "--steps", str(steps), "--quiet"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for steps in (1, 3)]
    printed = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        printed.append(stdout.strip())
    assert len(set(printed)) == 2  # each run names the folder it really wrote
    steps = sorted(json.loads((Path(p) / "meta.json").read_text())["steps"] for p in printed)
    assert steps == [1, 3]
    assert sorted(p.name for p in out.iterdir()) == ["a-red-circle-s0", "a-red-circle-s0-2"]
