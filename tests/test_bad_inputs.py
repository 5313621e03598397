"""Bad input gets a clear error, never a traceback or a hang (Python API).

Every bad generation setting is a `ValueError`, and every bad bundle a `BundleError` (a
`SpecEdgeError`), whose message names the bad value and what is allowed. Export-time checks
(a draft with another vocabulary or tokenizer) raise `ValueError` before anything is written.
Bundles are copied to tmp_path before they are damaged; the session fixtures stay intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from tiny_models import save_tiny

from specedge.export.bundle_writer import export_bundle
from specedge.runtime import BundleError, Generator, SpecEdgeError
from specedge.runtime.bundle import FORMAT_VERSION, MANIFEST

PROMPT = "hello world"


@pytest.fixture(scope="module")
def gen(tiny_bundle) -> Generator:
    return Generator.from_bundle(tiny_bundle)


@pytest.fixture(scope="module")
def no_draft_bundle(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny Llama target exported without any draft."""
    out = tmp_path_factory.mktemp("bundles") / "tiny-no-draft"
    export_bundle(str(tiny_checkpoints["llama"]), out)
    return out


def copy_bundle(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(src, dst)
    return dst


def edit_manifest(bundle: Path, change) -> None:
    path = bundle / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


# ---- generation settings ------------------------------------------------------------------

BAD_SETTINGS = [
    # (kwargs, regex the message must match: it names the value and the allowed range)
    (dict(prompt=""), r"the message is empty: write something to ask"),
    (dict(prompt="   \n"), r"the message is empty"),
    (dict(prompt="", raw=True), r"prompt is empty: give some text to continue"),
    (dict(messages=[{"role": "user", "content": " "}]), r"the message is empty"),
    (dict(messages=[{"role": "system", "content": ""}, {"role": "user", "content": ""}]),
     r"the message is empty"),
    (dict(prompt=PROMPT, max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
    (dict(prompt=PROMPT, max_new_tokens=-5), r"max_new_tokens must be an integer >= 1, got -5"),
    (dict(prompt=PROMPT, max_new_tokens=2.5), r"max_new_tokens must be an integer >= 1"),
    (dict(prompt=PROMPT, max_new_tokens=True), r"max_new_tokens must be an integer >= 1"),
    (dict(prompt=PROMPT, max_new_tokens=10_000),
     r"max_new_tokens \(10000\) exceeds the bundle's context of 512 tokens"),
    (dict(prompt_ids=[5] * 500, max_new_tokens=13),
     r"prompt \(500 tokens\) \+ max_new_tokens \(13\) exceeds the bundle's context of 512"),
    (dict(prompt="a" * 600, raw=True, max_new_tokens=1), r"exceeds the bundle's context"),
    (dict(prompt=PROMPT, temperature=-0.1), r"temperature must be a number >= 0.*-0\.1"),
    (dict(prompt=PROMPT, temperature=float("nan")), r"temperature must be a number >= 0.*nan"),
    (dict(prompt=PROMPT, temperature=float("inf")), r"temperature must be a number >= 0"),
    (dict(prompt=PROMPT, temperature="0.5"), r"temperature must be a number >= 0"),
    (dict(prompt=PROMPT, top_p=0.0), r"top_p must be in \(0, 1\].*0\.0"),
    (dict(prompt=PROMPT, top_p=-0.5), r"top_p must be in \(0, 1\].*-0\.5"),
    (dict(prompt=PROMPT, top_p=1.5), r"top_p must be in \(0, 1\].*1\.5"),
    (dict(prompt=PROMPT, top_p=float("nan")), r"top_p must be in \(0, 1\]"),
    (dict(prompt=PROMPT, top_k=-1), r"top_k must be an integer >= 0.*-1"),
    (dict(prompt=PROMPT, top_k=2.5), r"top_k must be an integer >= 0"),
    (dict(prompt=PROMPT, draft_tokens=0),
     r"draft_tokens must be an integer in \[1, 32\] or 'auto', got 0"),
    (dict(prompt=PROMPT, draft_tokens=-3),
     r"draft_tokens must be an integer in \[1, 32\] or 'auto', got -3"),
    (dict(prompt=PROMPT, draft_tokens=10000),
     r"draft_tokens must be an integer in \[1, 32\] or 'auto', got 10000"),
    (dict(prompt=PROMPT, draft_tokens="many"),
     r"draft_tokens must be an integer in \[1, 32\] or 'auto', got 'many'"),
    (dict(prompt="a\udcffb"), r"the prompt is not valid text: character 1 is '\\udcff'"),
    (dict(prompt=PROMPT, stop=["x"] * 33), r"stop has 33 strings; at most 32"),
    (dict(prompt=PROMPT, draft_threshold=1.0), r"draft_threshold must be in \[0, 1\)"),
    (dict(prompt=PROMPT, draft_threshold=-0.1), r"draft_threshold must be in \[0, 1\)"),
    (dict(prompt=PROMPT, drafter="ngram"), r"drafter must be one of model, prompt-lookup.*ngram"),
    (dict(prompt=PROMPT, drafter=""), r"drafter must be one of"),
    (dict(prompt_ids=[1, 34]), r"prompt_ids must be in \[0, 34\), got \[34\]"),
    (dict(prompt_ids=[1, 999, 2]), r"prompt_ids must be in \[0, 34\), got \[999\]"),
    (dict(prompt_ids=[-1, 3]), r"prompt_ids must be in \[0, 34\), got \[-1\]"),
    (dict(prompt_ids=[]), r"no tokens"),
    (dict(messages=[]), r"messages is empty"),
    (dict(messages=[{"role": "user"}]), r"each message needs 'role' and 'content'"),
    (dict(messages=["hi"]), r"each message needs 'role' and 'content'"),
    (dict(prompt=PROMPT, prompt_ids=[1, 2]), r"exactly one of prompt, prompt_ids or messages"),
    (dict(prompt=PROMPT, messages=[{"role": "user", "content": "x"}]), r"exactly one of"),
    (dict(), r"exactly one of prompt, prompt_ids or messages"),
    (dict(prompt=PROMPT, stop=[1]), r"stop must be a string or a list of strings"),
]


@pytest.mark.parametrize("kwargs, message", BAD_SETTINGS,
                         ids=[f"{i}-{sorted(k)}" for i, (k, _) in enumerate(BAD_SETTINGS)])
def test_bad_setting_is_a_clear_value_error(gen, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(**kwargs)


def test_bad_setting_raises_before_streaming_anything(gen):
    """`stream` validates at the first `next`, before any text is produced."""
    pieces = gen.stream(PROMPT, temperature=-1)
    with pytest.raises(ValueError, match="temperature"):
        next(pieces)


def test_generator_still_works_after_bad_calls(gen):
    """A rejected call leaves no half-done state behind."""
    expected = gen.generate(PROMPT, max_new_tokens=12).token_ids
    for kwargs, _ in BAD_SETTINGS[:12]:
        with pytest.raises(ValueError):
            gen.generate(**kwargs)
    assert gen.generate(PROMPT, max_new_tokens=12).token_ids == expected


@pytest.mark.parametrize("prompt_ids", [["a", "b"], [None], [1.5, 2.0]],
                         ids=["strings", "none", "floats"])
def test_prompt_ids_that_are_not_integers(gen, prompt_ids):
    """prompt_ids that are not integers are refused with a ValueError naming prompt_ids, not
    "invalid literal for int()" or a TypeError, and 1.5 is not silently truncated to 1."""
    with pytest.raises(ValueError, match="prompt_ids"):
        gen.generate(prompt_ids=prompt_ids, max_new_tokens=2)


def test_prompt_ids_not_a_sequence(gen):
    """An int for prompt_ids is a ValueError naming prompt_ids (not a TypeError from iterating
    an int)."""
    with pytest.raises(ValueError, match="prompt_ids"):
        gen.generate(prompt_ids=5, max_new_tokens=2)


def test_prompt_that_is_not_a_string(gen):
    """prompt=5 is reported as not being a string (not as "prompt is empty")."""
    with pytest.raises(ValueError, match=r"prompt must be a (str|string)"):
        gen.generate(prompt=5, max_new_tokens=2)


@pytest.mark.parametrize("seed", [-1, "x", 1.5])
def test_bad_seed_names_the_seed(gen, seed):
    """A bad seed is a ValueError naming the seed, not numpy's "expected non-negative integer"
    (for -1) or a TypeError from SeedSequence (for "x")."""
    with pytest.raises(ValueError, match="seed"):
        gen.generate(PROMPT, seed=seed, temperature=1.0, max_new_tokens=2)


def test_stop_none_is_not_a_type_error(gen):
    """stop=None means no stop strings (not a TypeError from iterating None)."""
    try:
        gen.generate(PROMPT, stop=None, max_new_tokens=4)
    except ValueError as e:
        assert "stop" in str(e)


def test_stop_given_as_a_bare_string(gen):
    """stop="ab" either means ["ab"] or is refused; it is never split into the stop strings
    "a" and "b"."""
    as_list = gen.generate(PROMPT, stop=["ab"], max_new_tokens=32).text
    try:
        as_string = gen.generate(PROMPT, stop="ab", max_new_tokens=32).text
    except ValueError as e:
        assert "stop" in str(e)
    else:
        assert as_string == as_list


# ---- drafters -----------------------------------------------------------------------------

def test_prompt_lookup_drafter_works_on_a_bundle(gen):
    plain = gen.generate(PROMPT, max_new_tokens=40, use_draft=False)
    lookup = gen.generate(PROMPT, max_new_tokens=40, drafter="prompt-lookup")
    assert lookup.stats["drafter"] == "prompt-lookup"
    assert lookup.stats["drafted_tokens"] > 0
    assert lookup.token_ids == plain.token_ids  # greedy: token for token


def test_model_drafter_on_a_bundle_without_draft(no_draft_bundle):
    gen = Generator.from_bundle(no_draft_bundle)
    assert gen.bundle.draft is None
    with pytest.raises(ValueError, match=r"no draft model.*prompt-lookup.*no-draft"):
        gen.generate(PROMPT, max_new_tokens=4)
    with pytest.raises(ValueError, match="no draft model"):
        gen.generate(PROMPT, max_new_tokens=4, drafter="model", use_draft=True)
    plain = gen.generate(PROMPT, max_new_tokens=16, use_draft=False)
    assert plain.stats["draft_calls"] == 0
    lookup = gen.generate(PROMPT, max_new_tokens=16, drafter="prompt-lookup")
    assert lookup.token_ids == plain.token_ids


def test_unknown_drafter_is_refused_even_without_drafting(gen):
    with pytest.raises(ValueError, match="drafter must be one of"):
        gen.generate(PROMPT, drafter="lookahead", max_new_tokens=2)


# ---- backends -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["no-such-backend", "", "ORT-CPU"])
def test_unknown_backend(tiny_bundle, backend):
    with pytest.raises(ValueError, match=rf"unknown backend '{backend}'; available: .*ort-cpu"):
        Generator.from_bundle(tiny_bundle, backend=backend)


def test_negative_threads(tiny_bundle):
    """`threads` is checked before a backend opens (runtime/config.py `check_threads`):
    -1 is refused, and so is a huge value (10**6), which would make ONNX Runtime try to start
    that many threads until the process is killed (not tested here for that reason)."""
    with pytest.raises(ValueError, match="threads"):
        Generator.from_bundle(tiny_bundle, threads=-1)


@pytest.mark.parametrize("spinning", ["off", "True", "AUTO", 0, 1, None])
def test_spinning_that_is_not_a_bool_or_auto(tiny_bundle, spinning):
    """`spinning` is True, False or "auto": a string such as "off" would otherwise read as
    true."""
    with pytest.raises(ValueError, match=r"spinning must be True, False or 'auto'.*got"):
        Generator.from_bundle(tiny_bundle, spinning=spinning)


# ---- damaged bundles ----------------------------------------------------------------------

def _truncate(bundle: Path) -> None:
    path = bundle / "target.onnx"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _grow(bundle: Path) -> None:
    with open(bundle / "draft.onnx", "ab") as f:
        f.write(b"\0" * 16)


def _garbage_same_size(bundle: Path) -> None:
    path = bundle / "target.onnx"
    path.write_bytes(os.urandom(path.stat().st_size))


def _swap_graphs(bundle: Path) -> None:
    """A valid ONNX graph of another model (the 1-layer draft) in the target's place."""
    shutil.copy(bundle / "draft.onnx", bundle / "target.onnx")
    size = (bundle / "target.onnx").stat().st_size
    edit_manifest(bundle, lambda m: m["models"]["target"].update(file_size=size))


DAMAGE = {
    "missing-manifest": (lambda b: (b / MANIFEST).unlink(), r"no manifest\.json in"),
    "manifest-not-json": (lambda b: (b / MANIFEST).write_text("{not json"),
                          r"manifest\.json is not valid JSON"),
    "manifest-empty": (lambda b: (b / MANIFEST).write_text(""), r"is not valid JSON"),
    "manifest-binary": (lambda b: (b / MANIFEST).write_bytes(b"\xff\xfe\x00\x81"),
                        r"is not valid JSON"),
    "manifest-a-list": (lambda b: (b / MANIFEST).write_text("[]"), r"no integer format_version"),
    "no-format-version": (lambda b: edit_manifest(b, lambda m: m.pop("format_version")),
                          r"no integer format_version"),
    "newer-format": (lambda b: edit_manifest(b, lambda m: m.update(
        format_version=FORMAT_VERSION + 1)),
        rf"format_version {FORMAT_VERSION + 1}, newer than this runtime's {FORMAT_VERSION}"
        r": upgrade specedge"),
    "no-models": (lambda b: edit_manifest(b, lambda m: m.pop("models")), r"no target model"),
    "target-entry-incomplete": (lambda b: edit_manifest(
        b, lambda m: m["models"]["target"].pop("file_size")),
        r"models\.target\.file_size must be a positive integer"),
    "other-kv-layout": (lambda b: edit_manifest(
        b, lambda m: m["models"]["draft"].update(kv_layout="bshd-paged")),
        r"models\.draft uses KV layout 'bshd-paged'"),
    "missing-target-onnx": (lambda b: (b / "target.onnx").unlink(),
                            r"bundle file missing: .*target\.onnx"),
    "missing-draft-onnx": (lambda b: (b / "draft.onnx").unlink(),
                           r"bundle file missing: .*draft\.onnx"),
    "truncated-onnx": (_truncate, r"target\.onnx is \d+ bytes, the manifest says \d+: it is "
                       r"truncated or was replaced"),
    "grown-onnx": (_grow, r"draft\.onnx is \d+ bytes, the manifest says \d+"),
    "garbage-onnx-right-size": (_garbage_same_size,
                                r"could not load .*target\.onnx.*corrupt or not an ONNX graph"),
    "other-graph-in-place": (_swap_graphs, r"target\.onnx does not have the bundle's inputs"),
    "missing-tokenizer": (lambda b: (b / "tokenizer.json").unlink(),
                          r"bundle file missing: .*tokenizer\.json"),
    "corrupt-tokenizer": (lambda b: (b / "tokenizer.json").write_text("{}"),
                          r"cannot read .*tokenizer\.json"),
    "missing-chat-template": (lambda b: (b / "chat_template.jinja").unlink(),
                              r"bundle file missing: .*chat_template\.jinja"),
    "draft-with-other-vocab": (lambda b: edit_manifest(
        b, lambda m: m["models"]["draft"].update(vocab_size=40)),
        r"the draft's vocabulary \(40 tokens\) differs from the target's \(34\)"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_bundle_is_a_bundle_error(tiny_bundle, tmp_path, damage):
    change, message = DAMAGE[damage]
    bundle = copy_bundle(tiny_bundle, tmp_path)
    change(bundle)
    with pytest.raises(BundleError, match=message) as info:
        Generator.from_bundle(bundle)
    assert isinstance(info.value, SpecEdgeError)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("path, says", [
    ("does-not-exist", r"bundle folder .*does-not-exist does not exist"),
    ("bundle/target.onnx", r"target\.onnx is a file, not a bundle folder"),
    ("bundle/.", None)])
def test_bundle_path_that_is_not_a_bundle_folder(tiny_bundle, tmp_path, path, says):
    """A missing folder and a file are named as such; a folder without a manifest says so."""
    copy_bundle(tiny_bundle, tmp_path)
    if says is None:
        (tmp_path / "bundle" / "manifest.json").unlink()
        says = r"no manifest\.json in .*specedge export"
    with pytest.raises(BundleError, match=says):
        Generator.from_bundle(tmp_path / path)


def test_self_draft_bundle_with_other_draft_vocab(tiny_self_draft_bundle, tmp_path):
    bundle = copy_bundle(tiny_self_draft_bundle, tmp_path)
    edit_manifest(bundle, lambda m: m["models"]["draft"].update(vocab_size=33))
    with pytest.raises(BundleError, match=r"draft's vocabulary \(33 tokens\)"):
        Generator.from_bundle(bundle)


MALFORMED_MANIFEST = {
    "tokenizer-null": lambda m: m.update(tokenizer=None),
    "tokenizer-a-list": lambda m: m.update(tokenizer=["tokenizer.json"]),
    "file-not-a-string": lambda m: m["models"]["target"].update(file=5),
    "eos-ids-not-ints": lambda m: m["tokenizer"].update(eos_token_ids=["</s>"]),
    "vocab-size-a-string": lambda m: m["models"]["target"].update(vocab_size="34"),
}


@pytest.mark.parametrize("case", list(MALFORMED_MANIFEST))
def test_manifest_with_wrong_types_is_a_bundle_error(tiny_bundle, tmp_path, case):
    """runtime/bundle.py `load_bundle` checks the types inside a JSON manifest, so
    wrong ones are a BundleError rather than tokenizer=null -> AttributeError, file=5 ->
    TypeError, eos_token_ids=["</s>"] -> "invalid literal for int()", or vocab_size="34" ->
    "the draft's vocabulary (34 tokens) differs from the target's (34)"."""
    bundle = copy_bundle(tiny_bundle, tmp_path)
    edit_manifest(bundle, MALFORMED_MANIFEST[case])
    with pytest.raises(BundleError, match=MANIFEST.replace(".", r"\.")):
        Generator.from_bundle(bundle).generate(PROMPT, max_new_tokens=2)


GRAPH_MISMATCH = {  # field: (change, what the message must name)
    "num_kv_heads": (lambda m: m["models"]["target"].update(num_kv_heads=3),
                     r"num_kv_heads|kv heads"),
    "head_dim": (lambda m: m["models"]["target"].update(head_dim=7), r"head_dim|head dim"),
    "vocab_size": (lambda m: [m["models"][r].update(vocab_size=40) for r in ("target", "draft")],
                   r"vocab"),
}


@pytest.mark.parametrize("field", list(GRAPH_MISMATCH))
def test_manifest_that_disagrees_with_its_graph(tiny_bundle, tmp_path, field):
    """A manifest whose dims disagree with its graph is a BundleError naming the field, not a
    bundle that loads fine and whose first generate dies in ONNX Runtime with a multi-line
    RuntimeError ("Got invalid dimensions for input ...")."""
    bundle = copy_bundle(tiny_bundle, tmp_path)
    change, message = GRAPH_MISMATCH[field]
    edit_manifest(bundle, change)
    with pytest.raises(BundleError, match=message):
        Generator.from_bundle(bundle).generate(PROMPT, max_new_tokens=4)


@pytest.mark.parametrize("template", ["{% for %}", "{{ raise_exception('no system role') }}"],
                         ids=["syntax-error", "raise-exception"])
def test_broken_chat_template(tiny_bundle, tmp_path, template):
    """A broken chat template is an error naming the template; jinja2's TemplateSyntaxError
    (from `from_string` in TextCodec.__init__) and TemplateError (from `render` in encode_chat)
    do not escape runtime/text.py."""
    bundle = copy_bundle(tiny_bundle, tmp_path)
    (bundle / "chat_template.jinja").write_text(template)
    with pytest.raises((ValueError, SpecEdgeError), match="template"):
        Generator.from_bundle(bundle).generate(PROMPT, max_new_tokens=2)


# ---- export-time checks -------------------------------------------------------------------

@pytest.fixture(scope="module")
def foreign_drafts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("foreign-drafts")
    return {"other-ids": save_tiny(root / "other-ids", other_ids=True),
            "vocab-20": save_tiny(root / "vocab-20", vocab_size=20)}


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == [], "export left files behind"


@pytest.mark.parametrize("draft, message", [
    ("other-ids", r"tokenizer maps tokens to different ids"),
    # A draft's embedding may be larger than its tokenizer (padded, as Qwen2.5's are): only
    # one too small for the shared tokenizer is refused.
    ("vocab-20", r"the draft's embedding has 20 rows but its tokenizer uses ids up to 33"),
])
def test_export_refuses_a_draft_with_another_vocabulary(tiny_checkpoints, foreign_drafts,
                                                        tmp_path, draft, message):
    out = tmp_path / "out" / "bundle"
    out.parent.mkdir()
    with pytest.raises(ValueError, match=message):
        export_bundle(str(tiny_checkpoints["llama"]), out, draft=str(foreign_drafts[draft]))
    assert_nothing_written(out)


@pytest.mark.parametrize("kwargs, message", [
    (dict(draft_layers=2), r"--draft-layers must be in \[1, 1\] for this 2-layer target, got 2"),
    (dict(draft_layers=0), r"--draft-layers"),
    (dict(max_context=0), r"--max-context must be an integer >= 1, got 0"),
    (dict(draft="DRAFT", draft_layers=1), r"--draft or --draft-layers, not both"),
], ids=["draft-layers-too-many", "draft-layers-zero", "max-context-zero", "draft-and-layers"])
def test_export_bad_arguments(tiny_checkpoints, tmp_path, kwargs, message):
    """draft_layers=0 is refused: 0 is falsy, so a plain truth test would take it for "no
    draft"."""
    out = tmp_path / "out" / "bundle"
    out.parent.mkdir()
    if kwargs.get("draft") == "DRAFT":
        kwargs = {**kwargs, "draft": str(tiny_checkpoints["llama"])}
    with pytest.raises(ValueError, match=message):
        export_bundle(str(tiny_checkpoints["llama"]), out, **kwargs)
    assert_nothing_written(out)


@pytest.mark.parametrize("model", ["does-not-exist", "config-less-folder"])
def test_export_model_that_is_not_a_checkpoint(tmp_path, model):
    (tmp_path / "config-less-folder").mkdir()
    out = tmp_path / "out" / "bundle"
    out.parent.mkdir()
    with pytest.raises(ValueError, match=r"is not a checkpoint folder \(with config\.json\)"):
        export_bundle(str(tmp_path / model), out)
    assert_nothing_written(out)


def test_export_over_a_folder_that_is_not_a_bundle(tiny_checkpoints, tmp_path):
    """`export_bundle` refuses a folder that exists, is not empty and holds no manifest.json:
    replacing `out` wholesale there would delete the user's files (`--out ~/Documents`)."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    try:
        export_bundle(str(tiny_checkpoints["llama"]), out)
    except (ValueError, OSError) as e:
        assert str(out) in str(e)
    assert (out / "notes.txt").read_text() == "precious"
