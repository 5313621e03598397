"""onnxruntime-genai's own int4 CPU models of a checkpoint, for `specedge bench`: built by
its model builder (`python -m onnxruntime_genai.models.builder`) from the Hugging Face
checkpoint a bundle was exported from, once, into the specedge cache, and reused.

A built model's folder is named after the checkpoint, the variant and a key over what the
builder reads and how it is asked to build (peer_models.py: the checkpoint's files, the
builder's options, the installed onnxruntime-genai's version).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from specedge.bench.peer_models import BuildError, build_once, checkpoint_key
from specedge.export.sources import cache_dir

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
    """16 hex digits that change with the checkpoint's files, the builder's options, or
    onnxruntime-genai's version (peer_models.py `checkpoint_key`)."""
    return checkpoint_key(checkpoint, {
        "precision": PRECISION, "execution_provider": EXECUTION_PROVIDER,
        "extra_options": list(variant.extra_options), "onnxruntime-genai": version})


def model_folder(checkpoint: Path, variant: Variant, version: str) -> Path:
    """Where the variant's model of `checkpoint` is cached:
    <specedge cache>/onnxruntime-genai/<checkpoint>-<variant>-<key>."""
    name = f"{Path(checkpoint).name}-{variant.slug}-{model_key(checkpoint, variant, version)}"
    return cache_dir() / "onnxruntime-genai" / name


def built_model(checkpoint: Path, variant: Variant, version: str) -> Path:
    """The folder of the variant's model of `checkpoint`: from the cache, or built into it
    (peer_models.py `build_once`). Building needs torch and transformers (the export
    extra), as the builder does: BuildError says so when they are missing."""
    out = model_folder(checkpoint, variant, version)
    if (out / CONFIG_FILE).is_file():
        return out
    if importlib.util.find_spec("torch") is None:
        raise BuildError("building its model needs torch and transformers "
                         "(pip install -e '.[export]')")
    return build_once(
        out, CONFIG_FILE, lambda tmp, scratch: builder_command(checkpoint, tmp, variant, scratch),
        f"onnxruntime-genai's {PRECISION} {variant.slug} model of {checkpoint}",
        f"onnxruntime-genai's model builder failed on {checkpoint}")
