"""The pages run as written: every Python snippet of README.md and docs/**/*.md (a page's snippets in order,
sharing one namespace, as a reader would), the README's quick start, and every link and figure that points
into the repository."""

import importlib
import inspect
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from unet.eval.report import check_readme
from unet.pipeline import shipped_models

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MODEL_CARD = ROOT / "docs" / "model-card.md"
SHIPPED = ROOT / "unet" / "pretrained"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
PROMPT = "a red circle left of a blue square"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"```.*?```", flags=re.S)


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)


def section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


# What each page's snippets must leave behind. A page that gains Python snippets needs an entry here.
def readme_results(ns):
    words, maps, daam = ns["words"], ns["maps"], ns["daam"]
    assert [w.text for w in words] == PROMPT.split()
    assert maps.shape == (len(words), 32, 32) and float(maps.sum()) > 0
    assert daam.shape == (len(words), 32, 32) and float(daam.sum()) > 0
    assert ns["image"].size == (32, 32) and ns["redder"].size == (32, 32)
    assert ns["store"].passes() > 0 and ns["louder"].reweight.factors == {2: 2.0}  # "red" is token 2


def maps_guide_results(ns):
    words = ns["words"]
    assert ns["refined"].shape == (len(words), 32, 32) and float(ns["refined"].sum()) > 0
    assert ns["segment"].shape == (len(words), 32, 32) and ns["segment"].dtype == torch.bool
    assert ns["segment"].any()


def control_guide_results(ns):
    assert ns["recorder"].recording.weights  # the recorded source run the edit replays
    assert ns["c"].reweight.factors == {6: 2.0}


def model_card_results(ns):
    assert ns["image"].size == (32, 32)


def untaught_card_results(ns):
    assert ns["image"].size == (32, 32) and Path(ns["pipe"].name_or_path).name == "scenes-32-untaught"


def scenes64_card_results(ns):
    assert ns["image"].size == (64, 64) and ns["pipe"].world == "scenes-64"


CHECKS = {"README.md": readme_results, "docs/guides/maps.md": maps_guide_results,
          "docs/guides/control.md": control_guide_results, "docs/model-card.md": model_card_results,
          "docs/model-card-scenes-32-untaught.md": untaught_card_results,
          "docs/model-card-scenes-64.md": scenes64_card_results}


def test_every_page_with_python_snippets_is_checked():
    assert {name(p) for p in PAGES if blocks(p, "python")} == set(CHECKS)


@pytest.mark.parametrize("page", sorted(CHECKS))
def test_python_snippets_run(page):
    namespace: dict = {}
    for block in blocks(ROOT / page, "python"):
        exec(compile(block, str(ROOT / page), "exec"), namespace)
    CHECKS[page](namespace)


def test_readme_imports_the_everyday_api_in_one_line():
    first = blocks(README, "python")[0]
    assert "from crossattn import AttentionStore, word_maps, maps_of, prompt_words, Controller\n" in first
    assert "from unet import load_pipeline\n" in first


def quick_start() -> list[list[str]]:
    part = section(README.read_text(), "## Quick start")
    lines = [line for block in re.findall(r"```bash\n(.*?)```", part, flags=re.S) for line in block.splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


RUN = re.compile(r'run\("([\w.]+)"(?:, "(\w+)")?\)')  # crossattn_launcher.run("module", "function")


def started(source: str) -> tuple[str, str]:
    """The module and function that a front end's `run(...)` line starts."""
    module, function = RUN.search(source).groups()
    return module, function or "main"


def entry_point(script: str):
    """The function `scripts/NAME.py` runs."""
    module, function = started((ROOT / script).read_text())
    return getattr(importlib.import_module(module), function)


def test_quick_start_runs_as_written(tmp_path, monkeypatch):
    commands = quick_start()
    assert [c[:2] for c in commands] == [["python", f"scripts/{s}.py"] for s in ("generate", "attend", "gallery")]
    monkeypatch.chdir(tmp_path)  # the commands' relative paths (outputs/...) land here
    for _, script, *args in commands:
        monkeypatch.setattr(sys, "argv", [script, *args])
        assert entry_point(script)() == 0, " ".join(args)

    run = tmp_path / "outputs" / "a-red-circle-left-of-a-blue-square-s0"  # the folder the README names
    for file in ("image_0.png", "overlay.png", "maps.safetensors", "meta.json", "index.html", "viewer_data.js"):
        assert (run / file).is_file(), file
    meta = json.loads((run / "meta.json").read_text())
    assert meta["prompt"] == PROMPT and meta["seed"] == 0 and meta["steps"] == 25
    assert Image.open(run / "image_0.png").size == (32, 32)
    assert sorted(p.name for p in (run / "words").iterdir()) == sorted(
        f"{i}_{w}.png" for i, w in enumerate(PROMPT.split()))

    (attended,) = (tmp_path / "outputs" / "attend").iterdir()
    assert json.loads((attended / "meta.json").read_text())["timestep"] == 100
    maps = load_file(str(attended / "maps.safetensors"))
    assert all(f"{i}_{w}" in maps for i, w in enumerate(PROMPT.split()))

    gallery = (tmp_path / "outputs" / "index.html").read_text()
    assert run.name in gallery and attended.name in gallery


def test_console_commands_the_readme_names_run_the_scripts(monkeypatch):
    table = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n")[1].split("\n\n")[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', table, flags=re.M))  # tomllib needs Python 3.11
    assert scripts
    assert set(re.findall(r"`(crossattn-\w+)`", README.read_text())) == set(scripts)
    monkeypatch.syspath_prepend(str(ROOT))  # top-level modules such as crossattn_launcher
    for command, target in scripts.items():
        module, function = target.split(":")
        entry = inspect.getsource(getattr(importlib.import_module(module), function))
        ran = started(entry) if RUN.search(entry) else (module, function)
        assert ran == started((ROOT / "scripts" / f"{command.removeprefix('crossattn-')}.py").read_text()), command


def test_every_link_and_figure_into_the_repository_exists():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path) if path else page
            if not file.exists():
                broken.append(f"{name(page)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{name(page)}: {target} (no such heading)")
            elif file.suffix in (".png", ".jpg"):
                Image.open(file).verify()
    assert not broken, broken
    figures = [t for p in PAGES for t in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", p.read_text())]
    assert len(figures) >= 10  # the pages show figures: a pattern that finds none is broken


def link_targets() -> set[Path]:
    targets = set()
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            path = target.partition("#")[0]
            if path and not re.match(r"[a-z]+:", target):
                targets.add((page.parent / path).resolve())
    return targets


def test_every_example_artefact_is_shown_or_linked_by_a_page():
    listed = subprocess.run(["git", "ls-files", "outputs/examples"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked artefacts are unknown")
    targets = link_targets()
    unlinked = [f for f in listed.stdout.split()
                if not {(ROOT / f).resolve(), *(ROOT / f).resolve().parents} & targets]
    assert not unlinked, unlinked  # git keeps what no page shows: remove it with git rm


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 350


def test_pages_name_no_session_issue_or_steering():
    for page in PAGES:
        found = re.findall(r".{0,30}(?:session|issue [0-9]|#[0-9]+|steer).{0,30}", page.read_text(), flags=re.I)
        assert not found, (name(page), found)


def model_card(model: str) -> Path:
    """The page of a shipped model's card: docs/model-card.md for the default, docs/model-card-NAME.md for another."""
    return MODEL_CARD if model == "scenes-32" else ROOT / "docs" / f"model-card-{model}.md"


def test_every_shipped_model_carries_its_model_card_standing_alone():
    assert "scenes-32" in shipped_models()
    for model in shipped_models():
        card = model_card(model).read_text()
        assert (SHIPPED / model / "README.md").read_text() == card, \
            f"copy {name(model_card(model))} to unet/pretrained/{model}/README.md"
        assert [t for t in LINK.findall(card) if not re.match(r"https?:", t)] == []  # relative links break on a hub
    check_readme(MODEL_CARD)  # one maps block, so `evaluate.py --readme docs/model-card.md` rewrites its tables
