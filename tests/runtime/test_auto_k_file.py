"""Auto K's measurements stored with a bundle (auto_k.json): a new Generator starts from the
draft's stored acceptance everywhere and from the stored step costs on the machine that
measured them; a file it cannot use is ignored with a warning; writing keeps what other
machines and sources stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import specedge.runtime.loop as loop
from specedge.runtime import Generator
from specedge.runtime.drafting import auto_k_file
from specedge.runtime.drafting.auto_k import HISTORY, Histories

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture
def bundle(own_tiny_bundle) -> Path:
    return own_tiny_bundle


def first_ks(gen: Generator, steps: int, **kwargs) -> list[int]:
    """The K auto chose for the first `steps` steps of one generation."""
    chosen = []
    original = loop.auto_k

    def spy(history, k_max):
        chosen.append(original(history, k_max))
        return chosen[-1]

    loop.auto_k = spy
    try:
        gen.generate(PROMPT, raw=True, max_new_tokens=steps + 1, draft_tokens="auto",
                     drafter="model", **kwargs)
    finally:
        loop.auto_k = original
    return chosen[:steps]


def record_with(acceptance: float, machine: dict | None = None, tries: float = 200.0) -> dict:
    """A stored record of the tiny bundle's draft accepted at `acceptance` at every
    position, with step costs of `machine` (a flat v(T): drafting is cheap)."""
    machines = [] if machine is None else [{
        "machine": machine, "written_by": "test", "date": "2026-01-01T00:00:00Z",
        "draft_seconds": [{"source": "model", "greedy": True, "seconds": 1e-4}],
        "verify_seconds": [{"greedy": True, "tokens": t, "seconds": 1e-2}
                           for t in range(1, 10)]}]
    return {"format": auto_k_file.FORMAT, "machines": machines,
            "acceptance": [{"source": "model", "greedy": True, "steps": int(tries),
                            "tries": [tries] * 8, "accepts": [acceptance * tries] * 8}]}


def test_record_and_seed_round_trip():
    """What a Histories measured, recorded and seeded into a new one, gives the same
    acceptance estimates and costs; counts weigh at most one window of HISTORY tries."""
    old = Histories()
    h = old.of("model", True)
    for i in range(300):
        h.observe(drafted=2, accepted=(i % 3 == 0) + (i % 6 == 0), seconds=0.02 + 1e-3 * (i % 2),
                  draft_seconds=2e-3, draft_calls=2)
    new = Histories()
    new.seed(json.loads(json.dumps(old.record())))
    seeded = new.of("model", True)
    # 300 undecayed tries per position become a window of HISTORY with the same rates.
    assert seeded.tries[0] == pytest.approx(HISTORY)
    assert seeded.accepts[0] / seeded.tries[0] == pytest.approx(h.total_accepts[0] / 300)
    assert seeded.accepts[1] / seeded.tries[1] == pytest.approx(h.total_accepts[1]
                                                                 / h.total_tries[1])
    assert seeded.draft == pytest.approx(h.draft)
    assert seeded.verify == pytest.approx(h.verify)
    without_costs = Histories()
    without_costs.seed(old.record(), costs=False)
    assert without_costs.of("model", True).draft is None
    assert without_costs.of("model", True).verify == {}
    assert without_costs.of("model", True).tries == seeded.tries


def test_stored_acceptance_sets_the_first_k(bundle):
    """From the prior, the first step drafts; a stored record that says the draft is never
    accepted starts at plain decoding, one that says it is always accepted drafts long."""
    prior = first_ks(Generator.from_bundle(bundle), 1)
    assert prior[0] >= 1
    (bundle / auto_k_file.FILE).write_text(json.dumps(record_with(0.0)))
    assert first_ks(Generator.from_bundle(bundle), 4) == [0, 0, 0, 0]
    gen = Generator.from_bundle(bundle)
    (bundle / auto_k_file.FILE).write_text(json.dumps(record_with(0.99, gen.machine)))
    assert first_ks(Generator.from_bundle(bundle), 1)[0] >= 5


def test_costs_are_used_only_on_the_machine_that_measured_them(bundle):
    gen = Generator.from_bundle(bundle, threads=1)
    other = {**gen.machine, "threads": 2}
    (bundle / auto_k_file.FILE).write_text(json.dumps(record_with(0.5, other)))
    elsewhere = Generator.from_bundle(bundle, threads=1)
    assert not elsewhere.stored_costs
    assert elsewhere._histories.of("model", True).draft is None
    assert elsewhere._histories.of("model", True).tries[0] == HISTORY  # acceptance still
    here = Generator.from_bundle(bundle, threads=2)
    assert here.stored_costs
    assert here._histories.of("model", True).draft == pytest.approx(1e-4)
    assert here._histories.of("model", True).verify[3] == pytest.approx(1e-2)


def test_save_measurements_then_reload(bundle):
    gen = Generator.from_bundle(bundle)
    spec = gen.generate(PROMPT, raw=True, max_new_tokens=24, drafter="model")
    path = gen.save_measurements("test")
    record = json.loads(path.read_text())
    (entry,) = [e for e in record["acceptance"] if e["source"] == "model"]
    # Every step of the generation is counted, and nothing else.
    assert entry["steps"] == spec.stats["target_calls"]  # decode steps; the prompt is none
    assert entry["tries"][:2] == pytest.approx(spec.stats["position_tries"][:2])
    assert entry["accepts"][:2] == pytest.approx(spec.stats["position_accepts"][:2])
    (machine,) = record["machines"]
    assert machine["machine"] == gen.machine and machine["written_by"] == "test"
    again = Generator.from_bundle(bundle)
    assert again.stored_costs
    assert again._histories.of("model", True).verify == pytest.approx(
        gen._histories.of("model", True).verify)


def test_writing_keeps_other_machines_and_sources(bundle):
    gen = Generator.from_bundle(bundle)
    other = {**gen.machine, "cpu": "another CPU"}
    old = record_with(0.5, other)
    old["acceptance"].append({**old["acceptance"][0], "source": "prompt-lookup"})
    (bundle / auto_k_file.FILE).write_text(json.dumps(old))
    gen.generate(PROMPT, raw=True, max_new_tokens=12, drafter="model")
    record = json.loads(gen.save_measurements("test").read_text())
    assert [m["machine"] for m in record["machines"]] == [other, gen.machine]
    sources = {e["source"] for e in record["acceptance"]}
    assert sources == {"model", "prompt-lookup"}
    (model,) = [e for e in record["acceptance"] if e["source"] == "model"]
    assert model["accepts"] != old["acceptance"][0]["accepts"]  # replaced by the new counts


@pytest.mark.parametrize("text", ["{not json", '{"format": 99}', '{"format": 1}',
                                  json.dumps({**record_with(0.5), "acceptance": [
                                      {"source": "model", "greedy": True, "steps": 1,
                                       "tries": [1, 2], "accepts": [1]}]}),
                                  json.dumps({**record_with(0.5), "acceptance": [
                                      {"source": "model", "greedy": "yes", "steps": 1,
                                       "tries": [1], "accepts": [1]}]})])
def test_a_file_that_cannot_be_used_is_ignored_with_a_warning(bundle, text):
    (bundle / auto_k_file.FILE).write_text(text)
    with pytest.warns(UserWarning, match="auto_k.json: ignored .*specedge bench"):
        gen = Generator.from_bundle(bundle)
    assert gen._histories.of("model", True).tries == [0.0] * 8  # the prior
    assert gen.generate(PROMPT, raw=True, max_new_tokens=6).token_ids  # still serves


def test_generating_writes_nothing_into_the_bundle(bundle):
    """The runtime only reads auto_k.json (a bundle on a device may be read-only): only
    save_measurements writes it."""
    gen = Generator.from_bundle(bundle)
    gen.generate(PROMPT, raw=True, max_new_tokens=12, drafter="model")
    assert not (bundle / auto_k_file.FILE).exists()
    gen.save_measurements("test")
    assert (bundle / auto_k_file.FILE).is_file()
