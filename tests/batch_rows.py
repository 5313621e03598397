"""Whether a target graph is batch invariant on this machine: the rows of one T-token call
against T one-token steps over the same cached prompt (docs/design.md, "Batch invariance of
quantized graphs"). Torch-free, so that the aarch64 check (tests/arm64/reference_decodes.py)
measures it there too."""

from __future__ import annotations

import numpy as np

from specedge.runtime.backends.ort_cpu import OrtCpuBackend


def steps_against_one_call(backend: OrtCpuBackend, prompt: list[int], new: list[int]
                           ) -> float:
    """Max |logit| difference between one len(new)-token call and len(new) one-token steps
    after the same prompt."""
    one = backend.new_cache(len(prompt) + len(new))
    backend.forward(one, prompt, 1)
    singles = np.stack([backend.forward(one, [t], 1)[-1].copy() for t in new])
    many = backend.new_cache(len(prompt) + len(new))
    backend.forward(many, prompt, 1)
    return float(np.abs(backend.forward(many, new, len(new)) - singles).max())
