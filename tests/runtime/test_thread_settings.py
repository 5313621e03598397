"""ONNX Runtime's thread settings: `threads` and `spinning` reach the sessions of both
graphs, as the options ONNX Runtime reads back, and never change greedy tokens."""

from __future__ import annotations

import pytest

from specedge.runtime import Generator
from specedge.runtime.backends import load_backend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.config import DEFAULT_SPINNING

PROMPTS = ["hello world", "the cat sat on the mat, the cat sat on the", "a, b, c!"]
ALLOW = "session.intra_op.allow_spinning"
STOP = "session.force_spinning_stop"


def session_threads(session) -> tuple[int, str, str]:
    """(intra-op threads, allow_spinning, force_spinning_stop) of a session's options."""
    options = session.get_session_options()
    return (options.intra_op_num_threads, options.get_session_config_entry(ALLOW),
            options.get_session_config_entry(STOP))


@pytest.mark.parametrize("threads, spinning, expected", [
    (1, False, (1, "0", "1")),
    (2, True, (2, "1", "1")),
    (2, False, (2, "0", "1")),
])
def test_settings_reach_both_sessions(tiny_bundle, threads, spinning, expected):
    gen = Generator.from_bundle(tiny_bundle, threads=threads, spinning=spinning)
    assert session_threads(gen.target.session) == expected
    assert session_threads(gen.draft.session) == expected


def test_from_bundle_defaults_to_auto_spinning(tiny_bundle):
    """The default, "auto", opens both sessions with one decision, a bool."""
    assert DEFAULT_SPINNING == "auto"
    gen = Generator.from_bundle(tiny_bundle, threads=1)
    assert isinstance(gen.spinning, bool)
    allow = "1" if gen.spinning else "0"
    assert session_threads(gen.target.session)[1] == allow
    assert session_threads(gen.draft.session)[1] == allow


def test_positional_threads_still_work(tiny_bundle):
    gen = Generator.from_bundle(tiny_bundle, "ort-cpu", 1)
    assert session_threads(gen.target.session)[0] == 1


@pytest.mark.parametrize("role", ["target", "draft"])
def test_settings_reach_the_host_emulated_engine(tiny_bundle, role):
    backend = load_backend("host-emulated", load_bundle(tiny_bundle), role, 1, False)
    assert session_threads(backend.engine.session) == (1, "0", "1")


@pytest.fixture(scope="module")
def reference(tiny_bundle) -> dict:
    """Plain decoding's greedy tokens on one thread, per prompt."""
    gen = Generator.from_bundle(tiny_bundle, threads=1, spinning=False)
    return {p: gen.generate(p, raw=True, max_new_tokens=24, use_draft=False).token_ids
            for p in PROMPTS}


@pytest.mark.parametrize("threads", [None, 1, 2])
@pytest.mark.parametrize("spinning", [True, False])
def test_greedy_tokens_do_not_depend_on_threads(tiny_bundle, reference, threads, spinning):
    gen = Generator.from_bundle(tiny_bundle, threads=threads, spinning=spinning)
    for prompt, expected in reference.items():
        for settings in ({"use_draft": False}, {}, {"draft_tokens": 3, "drafter": "model"}):
            got = gen.generate(prompt, raw=True, max_new_tokens=24, **settings).token_ids
            assert got == expected, (prompt, settings)


AFFINITIES = "session.intra_op_thread_affinities"


@pytest.mark.parametrize("spinning", [True, False])
def test_spinning_workers_are_pinned_one_core_each(tiny_bundle, spinning):
    """Spinning, the pools' workers sit on cores of their own and the calling thread on the
    first (cpu_placement.py); not spinning, nothing is pinned."""
    from specedge.runtime.backends.cpu_placement import cpu_placement

    gen = Generator.from_bundle(tiny_bundle, threads=2, spinning=spinning)
    placement = cpu_placement(2) if spinning else None
    for backend in (gen.target, gen.draft):
        assert backend.placement == placement
        options = backend.session.get_session_options()
        if placement is None:
            with pytest.raises(RuntimeError, match=AFFINITIES):
                options.get_session_config_entry(AFFINITIES)
        else:
            assert options.get_session_config_entry(AFFINITIES) == placement.workers
