"""The tiny bundles the tests decode, by name, and where they come from.

Normally each is exported from a tiny random-weight checkpoint (tests/tiny_models.py) when a
test first asks for it, which needs torch. Where the environment variable
SPECEDGE_TEST_BUNDLES names a folder, the bundles are read from it instead: they were
exported beforehand on another machine, with `python tests/tiny_bundles.py FOLDER`. That is
how the torch-free runtime tests run on aarch64 (scripts/test_arm64.sh), on bundles
exported on x86 as users do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PREBUILT_VARIABLE = "SPECEDGE_TEST_BUNDLES"

# name -> (tiny checkpoint, export arguments); a "draft" argument names a tiny checkpoint.
TINY_BUNDLES: dict[str, tuple[str, dict]] = {
    # The tiny Llama target (2 layers) with its first layer as the draft.
    "tiny": ("llama", dict(draft_layers=1)),
    # The portable attention layout ("bhsd-fixed"), which batched decoding takes too.
    "tiny-portable": ("llama", dict(draft_layers=1, attention="portable")),
    # Batched attention (KV layout "bhsd-inplace", several rows of several tokens a call).
    "tiny-batched": ("llama", dict(draft_layers=1, attention="batched")),
    "tiny-batched-int4": ("llama-h16", dict(draft_layers=1, attention="batched",
                                            precision="int4")),
    # GroupQueryAttention (head size 16), at each precision.
    "tiny-fused": ("llama-h16", dict(draft_layers=1, attention="fused")),
    "tiny-fused-int8": ("llama-h16", dict(draft_layers=1, attention="fused", precision="int8")),
    "tiny-fused-int4": ("llama-h16", dict(draft_layers=1, attention="fused", precision="int4")),
    # Draft == target: every draft token must be accepted.
    "tiny-self": ("llama", dict(draft="llama")),
}


def prebuilt_folder() -> Path | None:
    """The folder SPECEDGE_TEST_BUNDLES names, or None when the tests export their own."""
    folder = os.environ.get(PREBUILT_VARIABLE)
    return Path(folder) if folder else None


def prebuilt_bundle(folder: Path, name: str) -> Path:
    path = folder / name
    if not (path / "manifest.json").is_file():
        raise FileNotFoundError(
            f"{path} holds no bundle: {PREBUILT_VARIABLE}={folder} is read instead of exporting, "
            f"so export the tiny bundles there first: python tests/tiny_bundles.py {folder}")
    return path


def save_checkpoints(root: Path) -> dict[str, Path]:
    """The tiny checkpoints the bundles are exported from (torch and transformers)."""
    from tiny_models import save_tiny

    checkpoints = {arch: save_tiny(root / arch, arch)
                   for arch in ("llama", "qwen2", "mistral", "gpt2")}
    checkpoints["llama-h16"] = save_tiny(root / "llama-h16", "llama", hidden_size=64)
    return checkpoints


def export_tiny(name: str, checkpoints: dict[str, Path], out: Path) -> Path:
    """Export the tiny bundle `name` into `out`."""
    from specedge.export.bundle_writer import export_bundle

    checkpoint, arguments = TINY_BUNDLES[name]
    arguments = dict(arguments)
    if "draft" in arguments:
        arguments["draft"] = str(checkpoints[arguments["draft"]])
    export_bundle(str(checkpoints[checkpoint]), out, **arguments)
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python tests/tiny_bundles.py FOLDER  (exports every tiny "
                         "bundle into FOLDER/NAME)")
    out = Path(argv[0])
    checkpoints = save_checkpoints(out / "checkpoints")
    for name in TINY_BUNDLES:
        export_tiny(name, checkpoints, out / name)
        print(f"exported {out / name}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1:])
