"""What a newcomer copies from the README and the docs works as written: the bundle paths are
the ones the demo makes, the API key file can be made and is kept out of git, the wheel's
build tool is named, the demo says which drafter made each answer, and every link to a
file or a section of the docs leads somewhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DEMO = (ROOT / "scripts" / "demo.sh").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_names_the_bundle_the_demo_makes():
    made = re.search(r"^BUNDLE=(\S+)$", DEMO, re.M).group(1)
    named = set(re.findall(r"bundles/smollm2[\w.-]*", README))  # the default model's
    assert named == {made}, named


def test_the_api_key_file_can_be_made_and_stays_out_of_git():
    use = README.index("--api-key-file key.txt")
    assert "> key.txt" in README[:use]  # made before it is used
    r = subprocess.run(["git", "check-ignore", "-q", "key.txt"], cwd=ROOT)
    assert r.returncode == 0


def test_the_wheel_command_names_its_build_tool():
    line = next(line for line in README.splitlines() if "python -m build" in line)
    assert "pip install build" in line


def test_the_demo_says_which_drafter_made_each_answer():
    """Each `specedge generate` of the demo follows an echoed heading naming its drafter,
    and the export's JSON line is not printed among the answers."""
    lines = [line.strip() for line in DEMO.splitlines()]
    generates = [i for i, line in enumerate(lines) if line.startswith("specedge generate")]
    assert len(generates) == 2
    for i in generates:
        assert lines[i - 1].startswith('echo "== '), lines[i - 1]
    assert "the draft model elsewhere" in lines[generates[0] - 1]
    assert "--drafter model" in lines[generates[1] - 1]
    export = next(line for line in lines if line.startswith("--out") or "--verify" in line)
    assert "> /dev/null" in export


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(anchor)
    return out


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_links_to_files_and_sections_resolve(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here (no network)
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} -> no {file}"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file.read_text()), f"{page.name}: no section #{anchor}"


@pytest.mark.parametrize("script", ["test.sh", "demo.sh"])
def test_the_two_commands_install_again_only_when_pyproject_changes(script, tmp_path):
    """The README's two commands run their install block (scripts/*.sh, from `STAMP=` to its
    `fi`) on every call; it reaches pip only when the environment is missing or pyproject.toml
    changed since it was installed. Run here with a stand-in `python` that logs its calls."""
    text = (ROOT / "scripts" / script).read_text()
    block = text[text.index("STAMP="):text.index("\nfi\n", text.index("STAMP=")) + 4]
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    log = tmp_path / "calls.log"
    stand_in = f'#!/bin/sh\necho "$@" >> {log}\n'
    (tmp_path / "bin").mkdir()
    for name in ("python", "python3"):
        (tmp_path / "bin" / name).write_text(stand_in)
        (tmp_path / "bin" / name).chmod(0o755)
    # `python3 -m venv .venv` through the stand-in makes no folder: make what it would.
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text("")
    (venv / "python").write_text(stand_in)
    (venv / "python").chmod(0o755)
    (venv / "specedge").write_text(stand_in)
    (venv / "specedge").chmod(0o755)

    def run() -> str:
        log.write_text("")
        subprocess.run(["bash", "-c", f"set -euo pipefail\n{block}"], cwd=tmp_path, check=True,
                       env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
        return log.read_text()

    assert "pip install" in run()  # no stamp yet
    assert "pip install" not in run()  # the same pyproject.toml
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    assert "pip install" in run()


def test_the_demos_environment_runs_what_the_readme_shows_next():
    """After the demo, the README's next steps are `specedge serve` and an OpenAI client:
    the demo installs the serve extra, and the README names the client's package."""
    extras = re.search(r'pip install --quiet -e "\.\[([a-z,]+)\]"', DEMO).group(1).split(",")
    assert {"export", "serve"} <= set(extras)
    serve = README[README.index("## Serve it"):README.index("from openai import OpenAI")]
    assert "pip install openai" in serve
