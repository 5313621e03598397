"""The same decodes on two machines: token ids written on x86, checked on aarch64.

    python tests/arm64/reference_decodes.py write BUNDLES OUT.json  (where they were exported)
    python tests/arm64/reference_decodes.py check BUNDLES OUT.json  (on the other machine)

scripts/test_arm64.sh runs `write` on x86 and `check` under aarch64 emulation. For each bundle
folder of BUNDLES named in CASES, every prompt is decoded in the case's modes: plain (target
only), speculatively with the default drafter and auto K, and for the tiny bundles also with
the draft model at K = 4, with prompt lookup alone, and sampled with a seed and a fixed K.

`check` compares, on its own machine, every greedy decode with plain decoding (exactness of
speculative decoding) and with the ids `write` stored (the bundle decodes the same on both
CPUs), and the seeded sampled decodes with the stored ones. Required: the greedy equalities
of the fp32 bundles, and greedy equal to plain decoding for the int4 bundles on batched
attention, which stay batch invariant on aarch64. Reported: the int8 and int4 bundles'
agreement with x86, since their int8-activation kernels round their own way on each CPU;
greedy against plain decoding for the int8 and int4 bundles on fused attention, which are
not batch invariant on aarch64 (GroupQueryAttention; `batch_rows.py` measures it, printed
for every bundle); and the sampled decodes, since a sampled token falls where a uniform draw
meets the cumulative probabilities, which logits differing in their last bits may move.

`check` also starts `specedge serve` on SERVED, SmolLM2 int4 on batched attention, and asks
it for one greedy chat answer, which must equal the plain decode's text. It prints a
table, writes OUT.json's results beside it (`*.check.json`), and exits 1 when a required
check fails. Nothing here imports torch.
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
# mode -> generation settings; "plain" first, the greedy modes must equal it.
MODES: dict[str, dict] = {
    "plain": dict(use_draft=False),
    "speculative": dict(),
    "model-k4": dict(drafter="model", draft_tokens=4),
    "lookup": dict(drafter="prompt-lookup"),
    "sampled": dict(temperature=0.8, top_p=0.95, seed=11, draft_tokens=3),
}
GREEDY = ("plain", "speculative", "model-k4", "lookup")
# bundle folder -> (prompts, new tokens, modes). The tiny bundles come from
# tests/tiny_bundles.py; "smollm2-feature-int4" is the recommended SmolLM2 bundle (int4, the
# feature draft, batched attention: the default). Its decodes are long enough for int8/int4
# kernels that round their own way to show (plain decoding parted from x86 at tokens 28-44
# on three prompts in a trial), on three prompts, plain and with the default drafter: a
# SmolLM2 step takes ~0.4 s under emulation on a fast host and 3-4x that on a slow one.
SMOLLM2_PROMPTS = ("Why is the sky blue?", "Write a haiku about the sea.",
                   "Write a Python function that reverses a string.")
CASES: dict[str, tuple[tuple[str, ...], int, tuple[str, ...]]] = {
    "smollm2-feature-int4": (SMOLLM2_PROMPTS, 64, ("plain", "speculative")),
    "tiny": (("abc abc abc", "hello world", "the cat sat"), 32, tuple(MODES)),
    "tiny-portable": (("abc abc abc", "hello world"), 32, tuple(MODES)),
    "tiny-batched": (("abc abc abc", "hello world"), 32, tuple(MODES)),
    "tiny-batched-int4": (("abc abc abc", "hello world"), 32, tuple(MODES)),
    "tiny-fused-int8": (("abc abc abc", "hello world"), 32, tuple(MODES)),
    "tiny-fused-int4": (("abc abc abc", "hello world"), 32, tuple(MODES)),
}
# The bundle `specedge serve` answers a chat on: batch invariant on aarch64 too, so that its
# greedy answer (the server's default drafter and auto K) must be plain decoding's.
SERVED = "smollm2-feature-int4"


def decode(bundles: Path) -> tuple[dict, dict]:
    """{bundle: {prompt: {mode: token ids}}} and {bundle: {prompt: plain decode's text}}."""
    ids: dict = {}
    texts: dict = {}
    for name, (prompts, tokens, modes) in CASES.items():
        start = time.perf_counter()
        gen = Generator.from_bundle(bundles / name, threads=THREADS)
        ids[name], texts[name] = {}, {}
        for prompt in prompts:
            results = {mode: gen.generate(prompt, max_new_tokens=tokens, **MODES[mode])
                       for mode in modes}
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


def compare(here: dict, reference: dict, kinds: dict[str, tuple[str, str]]
            ) -> tuple[list[dict], bool]:
    """One row per bundle, prompt and mode; False when a required equality fails. `kinds`:
    each bundle's (precision, target attention)."""
    rows, ok = [], True
    for name, prompts in reference.items():
        precision, attention = kinds[name]
        for prompt, modes in prompts.items():
            plain = here[name][prompt]["plain"]
            for mode, ids in modes.items():
                got = here[name][prompt][mode]
                same = got == ids
                first = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b),
                             None if same else min(len(got), len(ids)))
                equals_plain = got == plain if mode in GREEDY else None
                greedy = mode in GREEDY
                needs_same = greedy and precision == "fp32"
                needs_plain = greedy and (precision == "fp32" or attention == "batched")
                ok &= (same or not needs_same) and (equals_plain or not needs_plain)
                rows.append(dict(bundle=name, precision=precision, attention=attention,
                                 prompt=prompt, mode=mode, tokens=len(got),
                                 same_as_reference=same, first_difference=first,
                                 equals_plain_here=equals_plain,
                                 required=" ".join(w for w, need in (("x86", needs_same),
                                                                     ("plain", needs_plain))
                                                   if need)))
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
    manifests = {name: load_bundle(bundles / name).manifest for name in CASES}
    kinds = {name: (m["precision"], m["models"]["target"]["attention"])
             for name, m in manifests.items()}
    here, texts = decode(bundles)
    rows, ok = compare(here, reference, kinds)
    print(f"{'bundle':22} {'mode':12} {'prompt':30} {'= x86':6} {'= plain':7} "
          f"{'required':9}")
    for r in rows:
        plain = "" if r["equals_plain_here"] is None else str(r["equals_plain_here"])
        where = "" if r["same_as_reference"] else f" (from token {r['first_difference']})"
        print(f"{r['bundle']:22} {r['mode']:12} {r['prompt'][:30]:30} "
              f"{str(r['same_as_reference']):6} {plain:7} {r['required'] or '-':9}{where}")
    invariance = {}
    for name in CASES:
        invariance[name] = batch_differences(bundles / name)
        print(f"{name}: a T-token call against T one-token steps, max |logit diff|: "
              + ", ".join(f"T={t} {d:.2g}" for t, d in invariance[name].items()))
    prompt, tokens = CASES[SERVED][0][0], CASES[SERVED][1]
    expected = texts[SERVED][prompt]
    served = served_chat(bundles / SERVED, prompt, tokens, reference_file.parent)
    same = served == expected
    print(f"specedge serve on {SERVED}: one greedy chat answer, "
          f"{'equal to' if same else 'NOT EQUAL TO'} the plain decode: {served!r}")
    out = reference_file.with_suffix(".check.json")
    out.write_text(json.dumps(dict(rows=rows, batch_differences=invariance, served=served,
                                   expected=expected, served_equals_plain=same), indent=1))
    return ok and same


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
