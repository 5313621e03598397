"""Shared fixtures: tiny exported bundles (seconds) and the real SmolLM2 bundle (cached).

The SmolLM2 bundle is exported once into the specedge cache (SPECEDGE_CACHE or
~/.cache/specedge) and reused by later runs: `export_bundle` skips an up-to-date bundle.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import save_tiny  # noqa: E402

from specedge.export.bundle_writer import export_bundle  # noqa: E402
from specedge.export.sources import cache_dir  # noqa: E402

# The distilled drafts shipped in drafts/ (made by `specedge distill`, see docs/distill.md).
SMOLLM2_DRAFT = Path(__file__).parent.parent / "drafts" / "smollm2-135m"
SMOLLM2_FEATURE_DRAFT = Path(__file__).parent.parent / "drafts" / "smollm2-135m-feature"


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    checkpoints = {arch: save_tiny(root / arch, arch)
                   for arch in ("llama", "qwen2", "mistral", "gpt2")}
    checkpoints["llama-h16"] = save_tiny(root / "llama-h16", "llama", hidden_size=64)
    return checkpoints


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoints, tmp_path_factory) -> Path:
    """Tiny Llama target (2 layers) with its first layer as the draft."""
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1)
    return out


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
def tiny_portable_bundle(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny Llama with a 1-layer draft on the portable attention layout ("bhsd-fixed"),
    which batched decoding takes too (exact at fp32)."""
    out = tmp_path_factory.mktemp("bundles") / "tiny-portable"
    export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1, attention="portable")
    return out


@pytest.fixture(scope="session")
def tiny_batched_bundle(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny Llama with a 1-layer draft on batched attention (KV layout "bhsd-inplace",
    several rows of several tokens a call): what batched decoding is exported for."""
    out = tmp_path_factory.mktemp("bundles") / "tiny-batched"
    export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1, attention="batched")
    return out


@pytest.fixture(scope="session")
def tiny_fused_bundle(tiny_checkpoints, tmp_path_factory) -> Path:
    """`tiny_bundle` on GroupQueryAttention (head size 16): KV layout "bhsd-inplace"."""
    out = tmp_path_factory.mktemp("bundles") / "tiny-fused"
    export_bundle(str(tiny_checkpoints["llama-h16"]), out, draft_layers=1, attention="fused")
    return out


@pytest.fixture(scope="session")
def tiny_self_draft_bundle(tiny_checkpoints, tmp_path_factory) -> Path:
    """Draft == target: every draft token must be accepted."""
    out = tmp_path_factory.mktemp("bundles") / "tiny-self"
    export_bundle(str(tiny_checkpoints["llama"]), out, draft=str(tiny_checkpoints["llama"]))
    return out


@pytest.fixture(scope="session")
def smollm2_bundle() -> Path:
    out = cache_dir() / "bundles" / "smollm2-fp32"
    export_bundle("smollm2-135m", out, draft=str(SMOLLM2_DRAFT))
    return out


@pytest.fixture(scope="session")
def smollm2_int8_bundle() -> Path:
    out = cache_dir() / "bundles" / "smollm2-int8"
    export_bundle("smollm2-135m", out, draft=str(SMOLLM2_DRAFT), precision="int8")
    return out


@pytest.fixture(scope="session")
def smollm2_int4_feature_bundle() -> Path:
    """The bundle `scripts/demo.sh` makes and the README recommends: int4, feature draft."""
    out = cache_dir() / "bundles" / "smollm2-feature-int4"
    export_bundle("smollm2-135m", out, draft=str(SMOLLM2_FEATURE_DRAFT), precision="int4")
    return out


@pytest.fixture(scope="session")
def smollm2_feature_bundle() -> Path:
    out = cache_dir() / "bundles" / "smollm2-feature-fp32"
    export_bundle("smollm2-135m", out, draft=str(SMOLLM2_FEATURE_DRAFT))
    return out


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
