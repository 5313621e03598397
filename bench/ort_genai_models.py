"""onnxruntime-genai's own int4 CPU models of a checkpoint, for `specedge bench`: built by
its model builder (`python -m onnxruntime_genai.models.builder`) from the Hugging Face
checkpoint a bundle was exported from, once, into the specedge cache, and reused.

A built model's folder is named after the checkpoint, the variant and a key over what the
builder reads and how it is asked to build (the checkpoint's files, their sizes and times,
the builder's options, the installed onnxruntime-genai's version): a rewritten checkpoint or
another builder gets a model of its own, and nothing is built twice.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specedge.export.sources import cache_dir
from specedge.runtime.atomic_files import replacing

PACKAGE = "onnxruntime-genai"
INSTALL = "pip install -e '.[peers]'"
# What the builder is asked for in every variant: int4 weights (MatMulNBits) for ONNX
# Runtime's CPU execution provider, as the bundles' int4 runs.
PRECISION, EXECUTION_PROVIDER = "int4", "cpu"
# A built model is complete once the builder wrote this, its last file.
CONFIG_FILE = "genai_config.json"


@dataclass(frozen=True)
class Variant:
    """One way of building the model: `name` in its systems' names and its cache folder
    ("" for the builder's CPU defaults), `extra_options` the builder's `--extra_options`."""

    name: str
    extra_options: tuple[str, ...] = ()

    @property
    def slug(self) -> str:
        return self.name or "default"


# The builder's CPU defaults (round-to-nearest int4, int8 activations in the matmuls), and
# its k-quant option, which also keeps the LM head at int8 ("k_quant_last").
DEFAULT = Variant("")
K_QUANT = Variant("k-quant", ("algo_config=k_quant_last",))
VARIANTS = (DEFAULT, K_QUANT)


def installed_version() -> str | None:
    """The installed onnxruntime-genai's version, None when it is not installed."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return None
    return importlib.metadata.version(PACKAGE)


def builder_command(checkpoint: Path, out: Path, variant: Variant,
                    hf_cache: Path) -> list[str]:
    """The model builder's command line: `checkpoint` (a Hugging Face folder) to an int4 CPU
    model in `out`, with `hf_cache` for the files it writes on the way."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder",
               "-i", str(checkpoint), "-o", str(out), "-p", PRECISION,
               "-e", EXECUTION_PROVIDER, "-c", str(hf_cache)]
    if variant.extra_options:
        command += ["--extra_options", *variant.extra_options]
    return command


def model_key(checkpoint: Path, variant: Variant, version: str) -> str:
    """16 hex digits that change with the checkpoint's files (names, sizes, modification
    times), the builder's options, or onnxruntime-genai's version."""
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                   for f in Path(checkpoint).iterdir() if f.is_file())
    what = {"checkpoint": str(Path(checkpoint).resolve()), "files": files,
            "precision": PRECISION, "execution_provider": EXECUTION_PROVIDER,
            "extra_options": list(variant.extra_options), "onnxruntime-genai": version}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def model_folder(checkpoint: Path, variant: Variant, version: str) -> Path:
    """Where the variant's model of `checkpoint` is cached:
    <specedge cache>/onnxruntime-genai/<checkpoint>-<variant>-<key>."""
    name = f"{Path(checkpoint).name}-{variant.slug}-{model_key(checkpoint, variant, version)}"
    return cache_dir() / "onnxruntime-genai" / name


class BuildError(RuntimeError):
    """The model builder failed; the message ends with its last line of output and names
    the file that holds all of it."""


def built_model(checkpoint: Path, variant: Variant, version: str) -> Path:
    """The folder of the variant's model of `checkpoint`: from the cache, or built into it
    (a line on stderr before and after; the builder's own output goes to a log file beside
    the model). Building needs torch and transformers (the export extra), as the builder
    does: BuildError says so when they are missing."""
    out = model_folder(checkpoint, variant, version)
    if (out / CONFIG_FILE).is_file():
        return out
    if importlib.util.find_spec("torch") is None:
        raise BuildError("building its model needs torch and transformers "
                         "(pip install -e '.[export]')")
    log = out.with_name(out.name + ".build.log")
    print(f"building onnxruntime-genai's {PRECISION} {variant.slug} model of "
          f"{checkpoint} into {out} (once; under a minute for a 135M model)", file=sys.stderr)
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out, folder=True) as tmp, \
            tempfile.TemporaryDirectory(dir=out.parent, prefix=".hf-") as hf_cache, \
            open(log, "w") as output:
        done = subprocess.run(builder_command(checkpoint, tmp, variant, Path(hf_cache)),
                              stdout=output, stderr=subprocess.STDOUT)
        if done.returncode != 0 or not (tmp / CONFIG_FILE).is_file():
            raise BuildError(f"onnxruntime-genai's model builder failed on {checkpoint} "
                             f"(exit status {done.returncode}): {_last_line(log)}; its "
                             f"output is in {log}")
    print(f"built {out.name} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return out


def _last_line(log: Path) -> str:
    """The log's last line that is not blank (the builder's progress bars use \\r)."""
    lines = [line.strip() for line in log.read_text(errors="replace")
             .replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
