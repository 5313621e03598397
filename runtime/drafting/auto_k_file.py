"""Auto K's measurements stored with a bundle, in `auto_k.json`, so that a new Generator
starts from what earlier runs measured (drafting/auto_k.py, `Histories.seed`).

    {"format": 1,
     "acceptance": [{"source", "greedy", "steps", "tries": [...], "accepts": [...]}],
     "machines": [{"machine": {"cpu", "backend", "threads"}, "written_by", "date",
                   "draft_seconds": [{"source", "greedy", "seconds"}],
                   "verify_seconds": [{"greedy", "tokens", "seconds"}]}]}

Acceptance is a property of the draft, the target and the prompts, so it holds on any
machine: the last run's counts replace the stored ones. The costs d and v(T) belong to one
machine, backend and thread count, so they are kept per machine and used only where they
were measured. `specedge export` writes the file after a short run of the shipped prompts
and `specedge bench` after its runs; the runtime only reads it, so a bundle on a read-only
device still loads. The file is a hint: one that cannot be read is ignored with a warning.
"""

from __future__ import annotations

import json
import platform
import time
import warnings
from pathlib import Path

from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.drafting.auto_k import Histories

FILE = "auto_k.json"
FORMAT = 1


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_of(backend: object, threads: int | None) -> dict:
    """What the costs depend on besides the bundle: the CPU, the backend, its thread pool
    (None: the backend's default). A GPU backend's costs are those of its GPU, which sits
    in one machine with its CPU, so the CPU name still tells machines apart."""
    return {"cpu": cpu_name(), "backend": getattr(backend, "name", str(backend)),
            "threads": threads}


def read(root: Path) -> dict | None:
    """The stored record of the bundle at `root`, None when there is none or it cannot be
    used (with a warning that says how to renew it)."""
    path = Path(root) / FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(f"format {record.get('format') if isinstance(record, dict) else '?'}"
                             f", this runtime reads format {FORMAT}")
        _check(record)
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"{path}: ignored ({e}); auto K starts from its prior. Run `specedge "
                      f"bench --bundle {root} --quick` to measure it again, or delete the file",
                      stacklevel=2)
        return None
    return record


def _check(record: dict) -> None:
    """KeyError / TypeError / ValueError unless every entry has the fields seed() reads."""
    for e in record["acceptance"]:
        if not (isinstance(e["source"], str) and isinstance(e["greedy"], bool)
                and len(e["tries"]) == len(e["accepts"])
                and all(float(n) >= 0 for n in e["tries"])
                and all(float(a) >= 0 for a in e["accepts"])):
            raise ValueError(f"bad acceptance entry {e}")
    for m in record["machines"]:
        if not isinstance(m["machine"], dict):
            raise ValueError(f"bad machine {m['machine']}")
        for e in m["draft_seconds"] + m["verify_seconds"]:
            if not (isinstance(e["greedy"], bool) and float(e["seconds"]) >= 0):
                raise ValueError(f"bad cost entry {e}")
        for e in m["verify_seconds"]:
            if not (isinstance(e["tokens"], int) and e["tokens"] >= 1):
                raise ValueError(f"bad cost entry {e}")


def seed(histories: Histories, record: dict, machine: dict) -> bool:
    """Seed `histories` from `record`: acceptance always, the costs of `machine` if stored.
    True when the costs were found."""
    costs = next((m for m in record["machines"] if m["machine"] == machine), None)
    histories.seed({**(costs or {}), "acceptance": record["acceptance"]},
                   costs=costs is not None)
    return costs is not None


def write(root: Path, histories: Histories, machine: dict, written_by: str) -> Path:
    """Store what `histories` measured in the bundle at `root` (atomically): its acceptance
    replaces the stored acceptance of the same sources, its costs those of `machine`;
    other machines' costs stay."""
    path = Path(root) / FILE
    old = read(root) if path.is_file() else None
    old = old or {"format": FORMAT, "acceptance": [], "machines": []}
    new = histories.record()
    measured = {(e["source"], e["greedy"]) for e in new["acceptance"]}
    acceptance = [e for e in old["acceptance"] if (e["source"], e["greedy"]) not in measured]
    machines = [m for m in old["machines"] if m["machine"] != machine]
    machines.append({"machine": machine, "written_by": written_by,
                     "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "draft_seconds": new["draft_seconds"],
                     "verify_seconds": new["verify_seconds"]})
    record = {"format": FORMAT, "acceptance": acceptance + new["acceptance"],
              "machines": machines}
    atomic_write(path, json.dumps(record, indent=1) + "\n")
    return path
