"""Writing files so that a reader, or the next run after a crash, sees the old file or the
new one and never a part: write beside the destination (same file system), then
`os.replace`, which is atomic."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_path(path: Path) -> Path:
    """A new empty file beside `path`, readable by all (mkstemp makes it private)."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(name, 0o644)
    return Path(name)


@contextmanager
def replacing(path: str | Path, folder: bool = False) -> Iterator[Path]:
    """A temporary file (or, with `folder`, a folder) beside `path` to write into; when the
    block ends without an error it replaces `path`, else it is removed. An old folder is
    kept until the new one is in place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not folder:
        tmp = temp_path(path)
        try:
            yield tmp
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write(path: str | Path, data: bytes | bytearray | memoryview | str) -> None:
    """Write `data` (text as UTF-8) to `path` atomically, creating its folder."""
    with replacing(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
