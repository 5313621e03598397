"""A peer's own model of a checkpoint, made by the peer's own tool (onnxruntime-genai's model
builder, OpenVINO's exporter) once into the specedge cache and reused: the folder is named
by a key over what the tool reads and how it is asked, so that a rewritten checkpoint or
another tool version gets a model of its own and nothing is made twice."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from specedge.runtime.atomic_files import replacing


class BuildError(RuntimeError):
    """A peer's tool failed to make its model; the message ends with the tool's last line of
    output and names the file that holds all of it."""


def bundle_checkpoint(bundle: Path) -> Path:
    """The Hugging Face folder the bundle was exported from (its manifest's source model:
    an alias, a GGUF file, a folder or a Hub id, as `specedge export` resolved it)."""
    from specedge.export.sources import resolve_checkpoint

    source = json.loads((Path(bundle) / "manifest.json").read_text())["source"]["model"]
    return resolve_checkpoint(source)


def checkpoint_key(checkpoint: Path, how: dict) -> str:
    """16 hex digits that change with the checkpoint's files (names, sizes, modification
    times) or with `how` the model is made (the tool's options and version)."""
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                   for f in Path(checkpoint).iterdir() if f.is_file())
    what = {"checkpoint": str(Path(checkpoint).resolve()), "files": files, **how}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def build_once(out: Path, done_file: str, command: Callable[[Path, Path], list[str]],
               what: str, failure: str) -> Path:
    """`out`, made by running `command(tmp, scratch)` (the tool writes the model into `tmp`,
    which becomes `out` once `done_file` is there; `scratch` is a folder for what it writes
    on the way) unless `out` holds `done_file` already. "building `what` into `out`" and
    "built" on stderr; the tool's output goes to a log file beside the model; BuildError
    "`failure` (exit status N): its last line" when it fails."""
    if (out / done_file).is_file():
        return out
    log = out.with_name(out.name + ".build.log")
    print(f"building {what} into {out} (once; about a minute for a 135M model)",
          file=sys.stderr)
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out, folder=True) as tmp, \
            tempfile.TemporaryDirectory(dir=out.parent, prefix=".scratch-") as scratch, \
            open(log, "w") as output:
        run = subprocess.run(command(tmp, Path(scratch)), stdout=output,
                             stderr=subprocess.STDOUT)
        if run.returncode != 0 or not (tmp / done_file).is_file():
            raise BuildError(f"{failure} (exit status {run.returncode}): {last_line(log)}; "
                             f"its output is in {log}")
    print(f"built {out.name} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return out


def last_line(log: Path) -> str:
    """The log's last line that is not blank (progress bars use \\r)."""
    lines = [line.strip() for line in log.read_text(errors="replace")
             .replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
