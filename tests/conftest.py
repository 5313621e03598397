"""Shared fixtures: tiny exported bundles (seconds) and the real SmolLM2 bundle (cached).

The SmolLM2 bundle is exported once into the specedge cache (SPECEDGE_CACHE or
~/.cache/specedge) and reused by later runs: `export_bundle` skips an up-to-date bundle.
The tiny bundles are exported per run, or read from the folder SPECEDGE_TEST_BUNDLES names
(tests/tiny_bundles.py): then nothing here imports torch or the export side, so that the
runtime tests run where only the runtime is installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The experiments' helpers the tests use too (scripts/experiments/gguf_writer.py), after the
# tests' own modules.
sys.path.append(str(Path(__file__).parent.parent / "scripts" / "experiments"))

from tiny_bundles import export_tiny, prebuilt_bundle, prebuilt_folder, save_checkpoints  # noqa: E402

# The distilled drafts shipped in drafts/ (made by `specedge distill`, see docs/distill.md).
SMOLLM2_DRAFT = Path(__file__).parent.parent / "drafts" / "smollm2-135m"
SMOLLM2_FEATURE_DRAFT = Path(__file__).parent.parent / "drafts" / "smollm2-135m-feature"


def smollm2(name: str, **arguments) -> Path:
    """SmolLM2-135M-Instruct exported with `arguments` into the cache's bundles/NAME (once)."""
    from specedge.export.bundle_writer import export_bundle
    from specedge.export.sources import cache_dir

    out = cache_dir() / "bundles" / name
    export_bundle("smollm2-135m", out, **arguments)
    return out


@pytest.fixture(scope="session", autouse=True)
def teacher_features_in_a_temporary_folder(tmp_path_factory):
    """The teacher features of the tiny models' corpora (export/distill/teacher.py) go to a
    folder of the test run: their checkpoints are new every run, so in the specedge cache
    they would pile up run after run. Where torch is not installed (the torch-free runtime
    tests), nothing makes them."""
    if importlib.util.find_spec("torch") is None:
        yield None
        return
    from specedge.export.distill import teacher

    root = tmp_path_factory.mktemp("specedge-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(teacher, "cache_dir", lambda: root)
        yield root


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    return save_checkpoints(tmp_path_factory.mktemp("checkpoints"))


def tiny(name: str, request, tmp_path_factory) -> Path:
    """The tiny bundle `name`: read from SPECEDGE_TEST_BUNDLES, or exported for this run."""
    folder = prebuilt_folder()
    if folder is not None:
        return prebuilt_bundle(folder, name)
    checkpoints = request.getfixturevalue("tiny_checkpoints")
    return export_tiny(name, checkpoints, tmp_path_factory.mktemp("bundles") / name)


@pytest.fixture(scope="session")
def tiny_bundle(request, tmp_path_factory) -> Path:
    """Tiny Llama target (2 layers) with its first layer as the draft."""
    return tiny("tiny", request, tmp_path_factory)


@pytest.fixture
def own_tiny_bundle(tiny_bundle, tmp_path) -> Path:
    """This test's own copy of `tiny_bundle` (links to its files): a test that stores auto
    K's measurements (auto_k.json) in it leaves the shared bundle as it was."""
    out = tmp_path / "own-tiny"
    out.mkdir()
    for f in Path(tiny_bundle).iterdir():
        if f.name != "auto_k.json":
            os.symlink(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_portable_bundle(request, tmp_path_factory) -> Path:
    """The tiny Llama with a 1-layer draft on the portable attention layout ("bhsd-fixed"),
    which batched decoding takes too (exact at fp32)."""
    return tiny("tiny-portable", request, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_batched_bundle(request, tmp_path_factory) -> Path:
    """The tiny Llama with a 1-layer draft on batched attention (KV layout "bhsd-inplace",
    several rows of several tokens a call): what batched decoding is exported for."""
    return tiny("tiny-batched", request, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_fused_bundle(request, tmp_path_factory) -> Path:
    """`tiny_bundle` on GroupQueryAttention (head size 16): KV layout "bhsd-inplace"."""
    return tiny("tiny-fused", request, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_fused_int4_bundle(request, tmp_path_factory) -> Path:
    """`tiny_fused_bundle` at int4."""
    return tiny("tiny-fused-int4", request, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_self_draft_bundle(request, tmp_path_factory) -> Path:
    """Draft == target: every draft token must be accepted."""
    return tiny("tiny-self", request, tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_bundle() -> Path:
    return smollm2("smollm2-fp32", draft=str(SMOLLM2_DRAFT))


@pytest.fixture(scope="session")
def smollm2_int8_bundle() -> Path:
    return smollm2("smollm2-int8", draft=str(SMOLLM2_DRAFT), precision="int8")


@pytest.fixture(scope="session")
def smollm2_int4_feature_bundle() -> Path:
    """The bundle `scripts/demo.sh` makes and the README recommends: int4, feature draft."""
    return smollm2("smollm2-feature-int4", draft=str(SMOLLM2_FEATURE_DRAFT), precision="int4")


@pytest.fixture(scope="session")
def smollm2_feature_bundle() -> Path:
    return smollm2("smollm2-feature-fp32", draft=str(SMOLLM2_FEATURE_DRAFT))


@pytest.fixture(scope="session")
def feature_draft(tiny_checkpoints, tmp_path_factory):
    """A feature draft distilled for the tiny Llama: (folder, config, metadata)."""
    from specedge.export.distill.config import DistillConfig
    from specedge.export.distill.train import distill

    out = tmp_path_factory.mktemp("feature") / "draft"
    cfg = DistillConfig(target=str(tiny_checkpoints["llama"]), kind="feature",
                        head_tokens=16, prompts=32, new_tokens=24, generate_batch=16,
                        epochs=2, batch=8)
    return out, cfg, distill(out, cfg)
