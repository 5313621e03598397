"""The export's steps as the user sees them: one progress bar, each step's time and peak
memory (the manifest's `export_steps`), and a failure named with the step and what to do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specedge.export.peak_memory import peak_mb, reset_peak

if TYPE_CHECKING:
    from tqdm import tqdm


class ExportError(RuntimeError):
    """An export step failed: the message names the step and what to do."""


# What to do when a step fails for a reason of the libraries' (torch, transformers, ONNX,
# ONNX Runtime), whose message alone does not say.
STEP_ADVICE = {
    "load models": "check that the model (and the draft) is a complete checkpoint that "
                   "transformers can load: config.json, the weights and the tokenizer files",
    "export target graph": "the model may use a feature the exporter does not handle; try "
                           "--attention portable, and report the model's architecture with "
                           "this message",
    "export draft graph": "the draft may use a feature the exporter does not handle; try "
                          "--attention portable or another draft, and report the draft's "
                          "architecture with this message",
    "verify graphs": "the graphs were exported but could not be run against transformers; "
                     "export without --verify to keep them, and report this message",
    "quantize": "export with --precision fp32 (or another precision), and report this "
                "message",
    "write bundle": "check that the folder of --out has free space and is writable",
}


def one_line(e: BaseException) -> str:
    """An error's message on one line (the command prints errors in one line)."""
    return " ".join(str(e).split()) or type(e).__name__


def step_error(name: str, e: Exception) -> ExportError:
    advice = STEP_ADVICE[name]
    return ExportError(f"export step '{name}' failed: {type(e).__name__}: {one_line(e)}. "
                       f"{advice[0].upper()}{advice[1:]}")


@dataclass
class ExportRun:
    """One export under way: the temporary folder it writes into, the arguments it records
    as the bundle's `source`, its progress bar, and each finished step's time and peak
    memory (`costs`, the manifest's `export_steps`)."""

    folder: Path
    source: dict
    progress: tqdm
    costs: list[dict] = field(default_factory=list)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run one export step: its failure becomes an ExportError naming the step, the
        library's message, and what to do (STEP_ADVICE). Interrupts and our own errors pass
        as they are. Appends the step's time and peak memory to `costs`."""
        self.progress.set_postfix_str(name)
        reset_peak()
        start = time.perf_counter()
        try:
            yield
        except ExportError:
            raise
        except Exception as e:
            raise step_error(name, e) from e
        self.costs.append({"step": name, "seconds": round(time.perf_counter() - start, 1),
                           "peak_rss_mb": peak_mb()})
        self.progress.update()
