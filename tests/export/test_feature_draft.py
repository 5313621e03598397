"""Feature drafts (EAGLE) on a tiny target: distill, export with the feature I/O, exactness,
and the drafter's cache rule (rows built on predicted features are rebuilt)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from safetensors.numpy import load_file
from two_samples import two_sample_pvalue

from specedge.export.bundle_writer import export_bundle
from specedge.export.distill.draft_folder import DRAFT_META, DRAFT_WEIGHTS
from specedge.runtime import Generator
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import MANIFEST, load_bundle
from specedge.runtime.config import Sampling
from specedge.runtime.drafting import FeatureDrafter
from specedge.runtime.errors import BackendUnavailableError, BundleError

HEAD = 16  # as in the feature_draft fixture (conftest.py)


@pytest.fixture(scope="module")
def feature_bundle(feature_draft, tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("feature") / "bundle"
    manifest = export_bundle(str(tiny_checkpoints["llama"]), out, draft=str(feature_draft[0]),
                             verify=True)
    return out, manifest


def test_draft_folder_holds_fc_and_one_layer(feature_draft):
    out, _, meta = feature_draft
    weights = load_file(str(out / DRAFT_WEIGHTS))
    assert {k.split(".")[0] for k in weights} == {"fc", "layer"}
    assert all(w.dtype == np.float16 for w in weights.values())
    saved = json.loads((out / DRAFT_META).read_text())
    assert saved["kind"] == "feature" and saved["num_layers"] == 1
    assert len(saved["head_token_ids"]) == HEAD


def test_export_writes_and_verifies_the_feature_io(feature_bundle):
    out, manifest = feature_bundle
    assert manifest["verify"]["draft"]["ok"] and manifest["verify"]["target"]["ok"]
    bundle = load_bundle(out)
    assert bundle.target.features == 32 and not bundle.target.reads_features
    assert bundle.draft.features == 32 and bundle.draft.reads_features
    names = [o["name"] for o in manifest["models"]["draft"]["inputs"]]
    assert names[-1] == "hidden_states_in"


@pytest.mark.parametrize("drafter,k", [("model", 1), ("model", 3), ("model", "auto"),
                                       ("lookup+model", 3)])
def test_greedy_speculative_equals_plain(feature_bundle, drafter, k):
    gen = Generator.from_bundle(feature_bundle[0])
    drafted = 0
    for prompt in ("hello world", "the cat sat", "why?"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=40, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=40, draft_tokens=k,
                            drafter=drafter)
        assert spec.token_ids == plain.token_ids
        drafted += spec.stats["drafted_tokens"]
    assert drafted > 0


def test_auto_prices_a_draft_step_without_its_catch_up(feature_bundle, monkeypatch):
    """The feature draft's first call takes in the whole prompt (and after steps at K = 0,
    every token it missed): a one-off that, priced as a draft step, made auto's d up to
    2.6 times too high (SmolLM2) and kept K at 0. Only steps whose draft kept pace feed d."""
    from specedge.runtime.drafting.auto_k import StepHistory

    seen = []
    real = StepHistory.observe

    def observe(self, drafted, accepted, seconds, draft_seconds=0.0, draft_calls=0):
        seen.append((drafted, draft_calls))
        real(self, drafted, accepted, seconds, draft_seconds, draft_calls)

    monkeypatch.setattr(StepHistory, "observe", observe)
    gen = Generator.from_bundle(feature_bundle[0])
    gen.generate("the cat sat on the mat", raw=True, max_new_tokens=24, draft_tokens=2,
                 drafter="model")
    assert seen[0][0] == 2 and seen[0][1] == 0      # the prompt's catch-up
    steady = [calls for drafted, calls in seen[1:] if drafted]
    assert len(steady) >= 5 and all(calls > 0 for calls in steady)


def test_incremental_drafts_equal_drafts_from_scratch(feature_bundle):
    """After a generation with many rejections, the drafter's cache (rows rebuilt from the
    target's features after each step) proposes what a new drafter proposes from the
    target's features of the whole context."""
    gen = Generator.from_bundle(feature_bundle[0])
    prompt = [1, 10, 7, 12]
    for seed in range(20):  # a generation that ends at max_new_tokens, not inside a chunk
        out = gen.generate(prompt_ids=prompt, max_new_tokens=30, draft_tokens=3,
                           drafter="model", temperature=1.0, seed=seed)
        if out.stop_reason == "max_new_tokens":
            break
    assert out.stop_reason == "max_new_tokens"
    assert out.stats["accepted_tokens"] < out.stats["drafted_tokens"]  # rollbacks happened
    context = prompt + out.token_ids
    sampling = Sampling(1.0)
    kept = gen._model_drafter
    ids_kept, q_kept = kept.propose(context, 3, sampling, np.random.default_rng(0))

    bundle = load_bundle(feature_bundle[0])
    target, fresh = OrtCpuBackend(bundle.target), FeatureDrafter(OrtCpuBackend(bundle.draft))
    cache = target.new_cache(kept.cache.capacity)
    target.forward(cache, context[:-1], 1)
    fresh.start(context, kept.cache.capacity)
    fresh.observe(target.features, 0)
    ids_fresh, q_fresh = fresh.propose(context, 3, sampling, np.random.default_rng(0))
    assert ids_kept == ids_fresh
    np.testing.assert_allclose([q.dense() for q in q_kept], [q.dense() for q in q_fresh],
                               atol=1e-5)


def test_sampling_is_exact(feature_bundle):
    """Two-sample chi-square (N = 1500 per arm, alpha = 0.001, seeds 0.. and 10000..) on
    the first three tokens: with max_new_tokens 4 and K = 2, t2 and t3 are the verified
    drafts (the second read the draft's own predicted feature) or their replacements."""
    gen = Generator.from_bundle(feature_bundle[0])

    def first_three(seed0: int, **kwargs) -> Counter:
        counts, drafted = Counter(), 0
        for i in range(1500):
            out = gen.generate(prompt_ids=[1, 10, 7], max_new_tokens=4, seed=seed0 + i,
                               temperature=1.0, **kwargs)
            counts[tuple(out.token_ids[:3])] += 1
            drafted += out.stats["drafted_tokens"]
        return counts, drafted

    plain, _ = first_three(0, use_draft=False)
    spec, drafted = first_three(10_000, draft_tokens=2, drafter="model")
    assert drafted >= 2 * 1500
    assert two_sample_pvalue(plain, spec) > 0.001


def test_device_backends_refuse_a_feature_bundle(feature_bundle):
    with pytest.raises(BackendUnavailableError, match="feature draft.*ort-cpu"):
        Generator.from_bundle(feature_bundle[0], backend="host-emulated")


def test_tensorrt_plan_refuses_a_feature_bundle(feature_bundle):
    from specedge.export.tensorrt.plan import plan_builds

    with pytest.raises(ValueError, match="feature draft"):
        plan_builds(load_bundle(feature_bundle[0]))


def test_manifest_with_reads_features_but_no_width_is_refused(feature_bundle, tmp_path):
    import shutil

    copy = tmp_path / "bundle"
    shutil.copytree(feature_bundle[0], copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["models"]["draft"]["features"] = 0
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="reads_features"):
        load_bundle(copy)


def test_draft_agreement_script_scores_an_oracle_draft_one(tiny_checkpoints):
    """scripts/experiments/draft_agreement.py lines pair r up with the answer token it
    predicts: a draft that returns the target's true next features agrees everywhere, one that
    returns the current features (one position behind) does not."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts" / "experiments"))
    import draft_agreement

    target, _, runs = draft_agreement.target_answers(str(tiny_checkpoints["llama"]), 4, 8)
    vocab = target.config.vocab_size

    class Oracle:
        specedge_head_ids = torch.arange(vocab)
        config = SimpleNamespace(hidden_size=target.config.hidden_size, vocab_size=vocab)

        def __init__(self, shift):
            self.shift = shift

        def predict(self, ids, features):
            # pair r holds f_r; the true next feature is f_{r+1} (the last pair has none)
            return torch.cat([features[:, 1:], features[:, -1:]], 1) if self.shift \
                else features

        def head_logits(self, features):
            return features @ target.lm_head.weight.T

    scores = [[draft_agreement.agreement(Oracle(shift), [run])["all"] for run in runs]
              for shift in (True, False)]
    assert scores[0] == [1.0] * len(runs)
    assert max(scores[1]) < 1.0


# ---- drafts that also read earlier target layers (EAGLE-3's mix, --feature-layers) ------


@pytest.fixture(scope="module")
def layered_draft(tiny_checkpoints, tmp_path_factory):
    """A feature draft for the tiny (2-layer) Llama that also reads its layer 0."""
    from specedge.export.distill.config import DistillConfig
    from specedge.export.distill.train import distill

    out = tmp_path_factory.mktemp("layered") / "draft"
    cfg = DistillConfig(target=str(tiny_checkpoints["llama"]), kind="feature",
                        head_tokens=16, prompts=32, new_tokens=24, generate_batch=16,
                        epochs=2, batch=8, feature_layers=[0])
    return out, distill(out, cfg)


def test_layered_draft_stores_its_fuse_and_layers(layered_draft):
    out, meta = layered_draft
    weights = load_file(str(out / DRAFT_WEIGHTS))
    assert {k.split(".")[0] for k in weights} == {"fc", "layer", "fuse"}
    assert weights["fuse.weight"].shape == (32, 2 * 32)   # [layer 0; final] -> H
    assert json.loads((out / DRAFT_META).read_text())["feature_layers"] == [0] == \
        meta["feature_layers"]
    assert sorted(p.name for p in (out / "work").glob("layers-0-*.pt")) == \
        ["layers-0-0000.pt", "layers-0-0001.pt"]   # 32 answers in chunks of 16


def test_layer_features_of_a_grown_last_chunk_are_made_again(tiny_checkpoints, tmp_path):
    """24 answers fill chunks of 16 and 8; 8 more prompts fill the second chunk, whose
    cached layer outputs (8) must be made again for its 16 answers."""
    import torch

    from specedge.export.distill.config import DistillConfig
    from specedge.export.distill.train import distill

    cfg = DistillConfig(target=str(tiny_checkpoints["llama"]), kind="feature",
                        head_tokens=16, prompts=24, new_tokens=8, generate_batch=16,
                        epochs=1, batch=8, feature_layers=[0])
    distill(tmp_path, cfg)
    chunk = tmp_path / "work" / "layers-0-0001.pt"
    assert len(torch.load(chunk)) == 8
    distill(tmp_path, DistillConfig(**{**cfg.__dict__, "more_prompts": 8}))
    assert len(torch.load(chunk)) == 16


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_layered_bundle_verifies_and_is_exact(layered_draft, tiny_checkpoints, tmp_path,
                                              precision):
    """fp32 and int4 (whose fuse product runs on no rows in plain decoding)."""
    manifest = export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b",
                             draft=str(layered_draft[0]), verify=True, precision=precision)
    assert manifest["verify"]["target"]["ok"] and manifest["verify"]["draft"]["ok"]
    gen = Generator.from_bundle(tmp_path / "b")
    drafted = 0
    for prompt in ("hello world", "the cat sat"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=32, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=32, draft_tokens=2,
                            drafter="model")
        assert spec.token_ids == plain.token_ids
        drafted += spec.stats["drafted_tokens"]
    assert drafted > 0


def test_target_graph_outputs_the_mixed_features(tiny_checkpoints, tmp_path):
    """The target graph computes fuse([rms(layer 0); final]) as transformers does, and the
    export's check tells it apart from the final norm's output alone."""
    import torch

    from specedge.export.drafts.feature import FeatureDraft
    from specedge.export.graph.trace import export_onnx
    from specedge.export.sources import load_model
    from specedge.export.verify import verify_graph

    target, _ = load_model(tiny_checkpoints["llama"])
    draft = FeatureDraft(target, torch.arange(HEAD), (0,))
    with torch.no_grad():
        draft.fuse.weight.copy_(torch.randn(draft.fuse.weight.shape,
                                            generator=torch.Generator().manual_seed(0)))
    export_onnx(target, str(tmp_path / "t.onnx"), features=draft)
    prompt = [1, 10, 7, 12, 9]
    assert verify_graph(target, tmp_path / "t.onnx", prompt, features=draft)["ok"]
    assert not verify_graph(target, tmp_path / "t.onnx", prompt, features=True)["ok"]


def test_features_are_computed_for_the_kept_positions_only(tiny_checkpoints, tmp_path):
    """features_to_keep F: the target graph's features are those of its last F positions,
    the logits and K/V rows do not depend on it, and with F = 0 the fuse product runs on
    no rows (plain decoding skips its work)."""
    import onnx
    import onnxruntime as ort
    import torch

    from specedge.export.drafts.feature import FeatureDraft
    from specedge.export.graph.trace import export_onnx
    from specedge.export.sources import load_model

    target, _ = load_model(tiny_checkpoints["llama"])
    draft = FeatureDraft(target, torch.arange(HEAD), (0,))
    export_onnx(target, str(tmp_path / "t.onnx"), features=draft)
    model = onnx.load(str(tmp_path / "t.onnx"))
    fuse = [n for n in model.graph.node if "hidden_states" in n.output]
    assert fuse[0].op_type == "MatMul" and "fuse" in fuse[0].name
    # what the fuse product multiplies: [rms(layer 0); final] of the kept positions
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(fuse[0].input[0]))
    session = ort.InferenceSession(model.SerializeToString())
    names = [o.name for o in session.get_outputs()]
    t, kv = 5, np.zeros((1, 2, 8, 8), np.float32)

    def run(keep: int) -> dict:
        feeds = {"input_ids": np.array([[1, 10, 7, 12, 9]]), "position_ids": np.arange(t)[None],
                 "past_length": np.array([0]), "logits_to_keep": np.array([1]),
                 "features_to_keep": np.array([keep])}
        feeds |= {i.name: kv for i in session.get_inputs() if i.name.startswith("past_key_values")}
        return dict(zip(names, session.run(None, feeds)))

    every, last2, none = run(t), run(2), run(0)
    assert every["hidden_states"].shape == (1, t, 32)
    np.testing.assert_array_equal(last2["hidden_states"], every["hidden_states"][:, -2:])
    assert none["hidden_states"].shape == (1, 0, 32)
    assert none[fuse[0].input[0]].shape == (1, 0, 64)
    assert every[fuse[0].input[0]].shape == (1, t, 64)
    for name in names[:5]:  # logits and the K/V rows
        np.testing.assert_array_equal(none[name], every[name])


def test_features_are_computed_only_for_a_feature_draft(feature_bundle):
    """The generator has the target compute its features only while a feature draft reads
    them: not in plain decoding, not for prompt lookup alone."""
    gen = Generator.from_bundle(feature_bundle[0])
    assert gen.bundle.target.keeps_features
    for drafter, use_draft, keeps in (("model", True, True), ("lookup+model", True, True),
                                      ("prompt-lookup", True, False), ("model", False, False)):
        gen.generate("the cat sat", raw=True, max_new_tokens=8, drafter=drafter,
                     use_draft=use_draft)
        assert gen.target.keep_features is keeps
        assert (gen.target.features is not None) is keeps


def test_a_new_layered_draft_reads_what_a_plain_one_does(tiny_checkpoints):
    """fuse starts as the identity on the final features: training starts from the same
    draft with or without earlier layers."""
    import torch

    from specedge.export.drafts.feature import FeatureDraft
    from specedge.export.graph.outputs import target_features
    from specedge.export.sources import load_model

    target, _ = load_model(tiny_checkpoints["llama"])
    draft = FeatureDraft(target, torch.arange(HEAD), (0,))
    layer0, final = torch.randn(1, 5, 32) * 7, torch.randn(1, 5, 32)
    with torch.no_grad():
        assert torch.equal(target_features(draft.fuse, [layer0], final), final)


@pytest.mark.parametrize("layers", [[1], [-1], [0, 5]])
def test_feature_layers_must_be_earlier_target_layers(tiny_checkpoints, layers):
    import torch

    from specedge.export.drafts.feature import FeatureDraft
    from specedge.export.sources import load_model

    target, _ = load_model(tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match="--feature-layers must be target layers 0..0"):
        FeatureDraft(target, torch.arange(HEAD), layers)


def test_distill_refuses_bad_feature_layers_before_any_answer(tiny_checkpoints, tmp_path):
    from specedge.export.distill.config import DistillConfig
    from specedge.export.distill.train import distill

    cfg = DistillConfig(target=str(tiny_checkpoints["llama"]), kind="feature", prompts=4,
                        new_tokens=4, feature_layers=[1])
    with pytest.raises(ValueError, match="--feature-layers must be target layers 0..0"):
        distill(tmp_path / "d", cfg)
    assert not list((tmp_path / "d" / "work").glob("data-*.pt"))


def test_feature_layers_need_a_feature_draft(tmp_path):
    from specedge.export.distill.config import DistillConfig
    from specedge.export.distill.train import distill

    with pytest.raises(ValueError, match="--feature-layers is for --kind feature"):
        distill(tmp_path / "d", DistillConfig(kind="model", feature_layers=[2]))
    assert not (tmp_path / "d").exists()


def test_draft_agreement_script_scores_its_first_step_as_the_first_draft_token(
        feature_draft, tiny_checkpoints):
    """`step_agreement`'s first step is the agreement of the first draft token, counted
    against the target's greedy answer tokens; later steps are scored on fewer positions."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts" / "experiments"))
    import draft_agreement

    from specedge.export.distill.draft_folder import load_draft

    target, tok, runs = draft_agreement.target_answers(str(tiny_checkpoints["llama"]), 4, 16)
    draft = load_draft(feature_draft[0], target, tok)
    first = draft_agreement.agreement(draft, runs, target)["all"]
    steps = draft_agreement.step_agreement(draft, runs, 3)
    assert len(steps) == 3 and all(0 <= s <= 1 for s in steps)
    assert steps[0] == pytest.approx(first, abs=1e-3)


def test_draft_report_script_prints_both_prompt_sets(feature_draft, tiny_checkpoints,
                                                      tmp_path):
    """scripts/experiments/draft_report.py end to end on the tiny draft: one row per prompt
    set and configuration, the teacher-forced steps beside the runtime's figures."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "scripts" / "experiments" / "draft_report.py"
    done = subprocess.run(
        [sys.executable, str(script), "--draft", str(feature_draft[0]), "--model",
         str(tiny_checkpoints["llama"]), "--precision", "fp32", "--max-new-tokens", "8",
         "--limit", "1", "--ks", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["sets"]) == {"bench", "examples"}
    for part in report["sets"].values():
        assert part["prompts"] == 1 and len(part["step_agreement"]) == 3
        assert {"draft K=1", "draft auto", "lookup+model auto"} <= set(part["runtime"])
        for row in part["runtime"].values():
            assert row["tokens_per_target_call"] >= 1 and row["speedup"] > 0
    assert done.stdout.count("| bench (1) |") == len(report["sets"]["bench"]["runtime"])
