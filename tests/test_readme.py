"""The README's Python snippets run as written (in order, sharing one namespace, as a reader would)."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_snippets_run():
    blocks = python_blocks()
    assert len(blocks) == 3  # capture, DAAM's maps, control: a new snippet should be run here too
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    words, maps = namespace["words"], namespace["maps"]
    assert maps.shape == (len(words), 32, 32) and float(maps.sum()) > 0
    assert namespace["segment"].shape == (len(words), 32, 32) and namespace["segment"].dtype == torch.bool
    assert namespace["recorder"].recording.weights  # the recorded source run the edit replays
