"""The package as a user installs it: a wheel built with `python -m build`, installed into a
clean virtual environment with the runtime dependencies only (no torch, no export extra),
runs `specedge generate` on a bundle and gives the same tokens as the source tree."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

from specedge.runtime import Generator

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out),
                        str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (path,) = out.glob("specedge-*.whl")
    return path


def test_wheel_holds_the_package_data_and_the_license(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "specedge/prompts.jsonl" in names
    assert "specedge/runtime/backends/kernels/sampling.cu" in names
    assert "specedge/serve/page.html" in names  # the chat page, GET /
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "scripts/", "drafts/")) for n in names)
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata


def test_every_package_folder_is_installed():
    """The package folders sit at the top level (export/, runtime/, serve/, bench/, specedge/)
    and pyproject.toml lists them one by one: a sub-package (or a folder of package data)
    added without its line there would be missing from the wheel and from editable
    installs."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = set()
    for name, top in tool["package-dir"].items():
        for folder in [ROOT / top, *(ROOT / top).rglob("*")]:
            holds_files = folder.is_dir() and any(f.is_file() for f in folder.iterdir())
            if holds_files and folder.name != "__pycache__":
                folders.add(".".join((name, *folder.relative_to(ROOT / top).parts)))
    assert folders == listed


def test_wheel_runs_generate_without_torch(wheel, tiny_bundle, tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    r = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True)
    assert r.returncode != 0  # the runtime install brings no torch
    r = subprocess.run([str(env / "bin" / "specedge"), "generate", "--bundle", str(tiny_bundle),
                        "--prompt", "hello", "--max-new-tokens", "12", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    installed = json.loads(r.stdout)
    here = Generator.from_bundle(tiny_bundle).generate("hello", max_new_tokens=12)
    assert installed["token_ids"] == here.token_ids
