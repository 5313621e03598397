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
