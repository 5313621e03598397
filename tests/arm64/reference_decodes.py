"""The same decodes on two machines: token ids written on x86, checked on aarch64.

    python tests/arm64/reference_decodes.py write BUNDLES OUT.json  (where they were exported)
    python tests/arm64/reference_decodes.py check BUNDLES OUT.json  (on the other machine)

scripts/test_arm64.sh runs `write` on x86 and `check` under aarch64 emulation. For each bundle
folder of BUNDLES named in CASES, every prompt is decoded plain (target only), speculatively
with the default drafter and auto K, with the draft model at K = 4, with prompt lookup alone,
and sampled with a seed and a fixed K.

`check` compares, on its own machine, every greedy decode with plain decoding (exactness of
speculative decoding) and with the ids `write` stored (the bundle decodes the same on both
CPUs), and the seeded sampled decodes with the stored ones. Required: the greedy equalities
of the fp32 bundles. Reported: the same for the int8 and int4 bundles, whose int8-activation
kernels round their own way on each CPU, and whose greedy speculative output equals plain
decoding only where the graph is batch invariant on the machine (`batch_rows.py`, measured
and printed for every bundle); and the sampled decodes, since a sampled token falls where a
uniform draw meets the cumulative probabilities, which logits differing in their last bits
may move. `check` also starts `specedge serve` on the first bundle of CASES, asks it for one
greedy chat answer (required: an answer) and compares it with the plain decode's text. It
prints a table, writes OUT.json's results beside it (`*.check.json`), and exits 1 when a
required check fails. Nothing here imports torch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from batch_rows import steps_against_one_call  # noqa: E402
from server_process import run_server  # noqa: E402

from specedge.runtime import Generator  # noqa: E402
from specedge.runtime.backends.ort_cpu import OrtCpuBackend  # noqa: E402
from specedge.runtime.bundle import load_bundle  # noqa: E402

THREADS = 2
# bundle folder -> (prompts, new tokens). The tiny bundles come from tests/tiny_bundles.py,
# "smollm2-feature-int4" is the recommended SmolLM2 bundle (int4 with the feature draft).
CASES: dict[str, tuple[tuple[str, ...], int]] = {
    "smollm2-feature-int4": (("Why is the sky blue?", "Write a haiku about the sea."), 24),
    "tiny": (("abc abc abc", "hello world", "the cat sat"), 32),
    "tiny-portable": (("abc abc abc", "hello world"), 32),
    "tiny-batched": (("abc abc abc", "hello world"), 32),
    "tiny-fused-int8": (("abc abc abc", "hello world"), 32),
    "tiny-fused-int4": (("abc abc abc", "hello world"), 32),
}
# mode -> generation settings; "plain" first, the greedy modes must equal it.
MODES: dict[str, dict] = {
    "plain": dict(use_draft=False),
    "speculative": dict(),
    "model-k4": dict(drafter="model", draft_tokens=4),
    "lookup": dict(drafter="prompt-lookup"),
    "sampled": dict(temperature=0.8, top_p=0.95, seed=11, draft_tokens=3),
}
GREEDY = ("plain", "speculative", "model-k4", "lookup")


def decode(bundles: Path) -> tuple[dict, dict]:
    """{bundle: {prompt: {mode: token ids}}} and {bundle: {prompt: plain decode's text}}."""
    ids: dict = {}
    texts: dict = {}
    for name, (prompts, tokens) in CASES.items():
        start = time.perf_counter()
        gen = Generator.from_bundle(bundles / name, threads=THREADS)
        ids[name], texts[name] = {}, {}
        for prompt in prompts:
            results = {mode: gen.generate(prompt, max_new_tokens=tokens, **settings)
                       for mode, settings in MODES.items()}
            ids[name][prompt] = {mode: r.token_ids for mode, r in results.items()}
            texts[name][prompt] = results["plain"].text
        print(f"{name}: decoded in {time.perf_counter() - start:.1f} s", flush=True)
    return ids, texts


def served_chat(bundle: Path, prompt: str, tokens: int, logs: Path) -> str:
    """One greedy chat answer from `specedge serve` on `bundle`."""
    with run_server(bundle, logs, "--threads", str(THREADS)) as server:
        answer = server.client(timeout=600).chat.completions.create(
            model=bundle.name, max_tokens=tokens, temperature=0,
            messages=[{"role": "user", "content": prompt}])
    return answer.choices[0].message.content


def compare(here: dict, reference: dict, precisions: dict[str, str]
            ) -> tuple[list[dict], bool]:
    """One row per bundle, prompt and mode; False when a required equality fails."""
    rows, ok = [], True
    for name, prompts in reference.items():
        for prompt, modes in prompts.items():
            plain = here[name][prompt]["plain"]
            for mode, ids in modes.items():
                got = here[name][prompt][mode]
                same = got == ids
                first = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b),
                             None if same else min(len(got), len(ids)))
                equals_plain = got == plain if mode in GREEDY else None
                required = mode in GREEDY and precisions[name] == "fp32"
                ok &= not required or (same and equals_plain)
                rows.append(dict(bundle=name, precision=precisions[name], prompt=prompt,
                                 mode=mode, tokens=len(got),
                                 same_as_reference=same, first_difference=first,
                                 equals_plain_here=equals_plain, required=required))
    return rows, ok


def batch_differences(bundle: Path, calls: tuple[int, ...] = (2, 5, 9)) -> dict[int, float]:
    """{T: max |logit| difference between a T-token target call and T one-token steps}."""
    backend = OrtCpuBackend(load_bundle(bundle).target, threads=THREADS)
    vocab = backend.spec.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(20)]
    return {t: steps_against_one_call(backend, prompt, [(11 * i + 5) % vocab for i in range(t)])
            for t in calls}


def check(bundles: Path, reference_file: Path) -> bool:
    reference = json.loads(reference_file.read_text())
    precisions = {name: load_bundle(bundles / name).manifest["precision"] for name in CASES}
    here, texts = decode(bundles)
    rows, ok = compare(here, reference, precisions)
    print(f"{'bundle':22} {'mode':12} {'prompt':30} {'= x86':6} {'= plain':7}")
    for r in rows:
        plain = "" if r["equals_plain_here"] is None else str(r["equals_plain_here"])
        where = "" if r["same_as_reference"] else f" (from token {r['first_difference']})"
        mark = "" if r["required"] or not (where or plain == "False") else " (reported)"
        print(f"{r['bundle']:22} {r['mode']:12} {r['prompt'][:30]:30} "
              f"{str(r['same_as_reference']):6} {plain:7}{where}{mark}")
    invariance = {}
    for name in CASES:
        invariance[name] = batch_differences(bundles / name)
        print(f"{name}: a T-token call against T one-token steps, max |logit diff|: "
              + ", ".join(f"T={t} {d:.2g}" for t, d in invariance[name].items()))
    name = next(iter(CASES))
    prompt, tokens = CASES[name][0][0], CASES[name][1]
    expected = texts[name][prompt]
    served = served_chat(bundles / name, prompt, tokens, reference_file.parent)
    same = served == expected
    print(f"specedge serve on {name}: one greedy chat answer, "
          f"{'equal to' if same else 'not equal to'} the plain decode: {served!r}")
    out = reference_file.with_suffix(".check.json")
    out.write_text(json.dumps(dict(rows=rows, batch_differences=invariance, served=served,
                                   expected=expected, served_equals_plain=same), indent=1))
    return ok and bool(served)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("write", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    bundles, file = Path(argv[1]), Path(argv[2])
    if argv[0] == "write":
        file.write_text(json.dumps(decode(bundles)[0], indent=1))
        print(f"wrote {file}")
        return 0
    ok = check(bundles, file)
    print("cross-architecture decodes: " + ("all required equalities hold" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
