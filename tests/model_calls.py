"""Which calls a Generator's models run: a spy on OrtCpuBackend's calls, for tests that
check how much of a prompt ran (prompt chunks, rows kept from an earlier sequence)."""

from __future__ import annotations

from specedge.runtime import Generator
from specedge.runtime.backends.ort_cpu import OrtCpuBackend


def spy_calls(monkeypatch, gen: Generator, names: tuple[str, ...] = ("forward", "forward_slots")
              ) -> list[tuple[str, int]]:
    """From now on, the (model, tokens a row) of every call of gen's models through the
    OrtCpuBackend methods `names` ("forward": one row; "forward_slots": several), in order;
    the model is "target" or "draft"."""
    calls: list[tuple[str, int]] = []
    originals = {name: getattr(OrtCpuBackend, name) for name in names}

    def spy(name):
        def call(self, cache_or_caches, *args, **kwargs):
            role = "target" if self is gen.target else "draft"
            calls.append((role, len(args[0]) if name == "forward" else
                          max(len(t) for t in args[1].values())))
            return originals[name](self, cache_or_caches, *args, **kwargs)
        return call

    for name in originals:
        monkeypatch.setattr(OrtCpuBackend, name, spy(name))
    return calls
