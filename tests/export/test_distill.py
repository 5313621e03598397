"""`specedge distill` on a tiny target: the draft folder, resuming, export with a head over
only some tokens (q = 0 elsewhere), and exactness against the target."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tiny_models import save_tiny
from two_samples import two_sample_pvalue

from specedge.export.bundle_writer import export_bundle
from specedge.export.distill.config import DistillConfig
from specedge.export.distill.data import generate_shard
from specedge.export.distill.draft_folder import (
    DRAFT_META,
    DRAFT_WEIGHTS,
    is_target_part,
    load_draft,
)
from specedge.export.distill.prompts import training_prompts
from specedge.export.distill.train import distill, new_draft
from specedge.export.sources import load_model
from specedge.gpu_check.two_sample import first_two_tokens
from specedge.runtime import Generator

HEAD = 16


@pytest.fixture(scope="module")
def distilled(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "draft"
    cfg = DistillConfig(target=str(tiny_checkpoints["llama"]), layers=1, head_tokens=HEAD,
                        prompts=48, new_tokens=24, generate_batch=16, epochs=3, batch=8)
    meta = distill(out, cfg)
    return out, cfg, meta


@pytest.fixture(scope="module")
def distilled_bundle(distilled, tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "bundle"
    manifest = export_bundle(str(tiny_checkpoints["llama"]), out, draft=str(distilled[0]),
                             verify=True)
    return out, manifest


def test_draft_folder_holds_only_what_is_new(distilled):
    out, cfg, meta = distilled
    weights = load_file(str(out / DRAFT_WEIGHTS))
    assert not any("embed_tokens" in k or "lm_head" in k for k in weights)
    assert all(w.dtype == np.float16 for w in weights.values())
    assert {k.split(".")[2] for k in weights if k.startswith("model.layers.")} == {"0"}
    saved = json.loads((out / DRAFT_META).read_text())
    assert saved["num_layers"] == 1 and len(saved["head_token_ids"]) == HEAD
    assert saved["head_token_ids"] == sorted(set(saved["head_token_ids"]))
    assert saved["config"]["seed"] == 0 and saved["answer_tokens"] > 0
    assert 0 <= meta["report"]["val_top1_agreement"] <= 1


def test_other_training_settings_reuse_the_data(distilled, tmp_path):
    import shutil

    out, cfg, _ = distilled
    copy = tmp_path / "draft"
    shutil.copytree(out, copy)
    shards = {p.name: p.stat().st_mtime_ns for p in (copy / "work").glob("data-*.pt")}
    meta = distill(copy, DistillConfig(**{**cfg.__dict__, "epochs": 1}))
    assert {p.name: p.stat().st_mtime_ns for p in (copy / "work").glob("data-*.pt")} == shards
    assert meta["report"]["steps"] < json.loads((out / DRAFT_META).read_text())["report"][
        "steps"]


@pytest.mark.parametrize("which", ["distilled", "feature_draft"])
def test_training_improves_on_the_untrained_draft(which, request):
    """The loss after training is below the loss of the freshly initialised draft."""
    from specedge.export.distill.data import head_token_ids
    from specedge.export.distill.losses import draft_loss
    from specedge.export.distill.train import new_draft

    out, cfg, meta = request.getfixturevalue(which)
    data = []
    for shard in sorted((out / "work").glob("data-*.pt")):
        data += torch.load(shard)
    target, _ = load_model(cfg.target)
    head = head_token_ids(data, cfg.head_tokens, target.config.vocab_size)
    with torch.no_grad():
        before = draft_loss(new_draft(target, cfg, head), head, data[::20])[0].item()
    assert meta["report"]["val_loss"] < before


def test_rerun_resumes_instead_of_redoing(distilled):
    out, cfg, _ = distilled
    shards = {p: p.stat().st_mtime_ns for p in (out / "work").glob("data-*.pt")}
    state = (out / "work" / "train.pt").stat().st_mtime_ns
    distill(out, cfg)
    assert {p: p.stat().st_mtime_ns for p in shards} == shards
    assert (out / "work" / "train.pt").stat().st_mtime_ns == state


def test_rerun_with_other_data_settings_is_refused(distilled):
    out, cfg, _ = distilled
    with pytest.raises(ValueError, match="data generated with other settings"):
        distill(out, DistillConfig(**{**cfg.__dict__, "new_tokens": 99}))


def test_more_prompts_keep_the_data_made_without_them(distilled, tmp_path):
    """--more-prompts answers its prompts in shards after the others, so data made without
    them stays; once they are made, another count would need other shards and is refused."""
    import shutil

    out, cfg, meta = distilled
    copy = tmp_path / "draft"
    shutil.copytree(out, copy)
    shards = {p.name: p.stat().st_mtime_ns for p in (copy / "work").glob("data-*.pt")}
    # as a version before --more-prompts wrote it: a missing setting reads as its default
    settings = copy / "work" / "data-settings.json"
    settings.write_text(json.dumps({k: v for k, v in json.loads(settings.read_text()).items()
                                    if k != "more_prompts"}))
    more = DistillConfig(**{**cfg.__dict__, "more_prompts": 20, "epochs": 1})
    grown = distill(copy, more)
    now = {p.name: p.stat().st_mtime_ns for p in (copy / "work").glob("data-*.pt")}
    assert {k: now[k] for k in shards} == shards
    added = sorted(set(now) - set(shards))
    assert added == [f"data-{len(shards) + i:04d}.pt" for i in range(2)]  # 16 + 4 prompts
    answers = [len(ex["top_ids"]) for name in added for ex in torch.load(copy / "work" / name)]
    assert len(answers) == 20
    assert grown["answer_tokens"] == meta["answer_tokens"] + sum(answers)
    with pytest.raises(ValueError, match="data generated with other settings"):
        distill(copy, DistillConfig(**{**more.__dict__, "more_prompts": 40}))


def test_shards_hold_the_targets_own_top_log_probs(tiny_checkpoints):
    """Each answer position's top-k log-probabilities are the target's, teacher-forced on
    the shard's ids (fp16 storage; two prompts, so one of them is left-padded), and greedy
    answers are their top-1 tokens."""
    model, tokenizer = load_model(str(tiny_checkpoints["llama"]))
    cfg = DistillConfig(new_tokens=12, top_k=4)
    for sampled in (False, True):
        for ex in generate_shard(model, tokenizer, training_prompts(2, 0), cfg, sampled, 0):
            with torch.no_grad():
                logits = model(ex["ids"][None].long()).logits[0].float()
            start, n = ex["start"], len(ex["top_ids"])
            want = torch.log_softmax(logits[start:start + n], dim=-1).topk(cfg.top_k, dim=-1)
            assert torch.allclose(ex["top_logp"].float(), want.values, atol=2e-2)
            assert torch.equal(ex["top_ids"][:, 0].long(), want.indices[:, 0])
            if not sampled:
                assert torch.equal(ex["ids"][start + 1:start + 1 + n], ex["top_ids"][:, 0])


@pytest.mark.parametrize("setting", ["varied_prompts", "more_prompts", "self_prompts"])
def test_negative_prompt_count_is_refused_before_any_work(setting, tmp_path):
    with pytest.raises(ValueError, match="--varied-prompts, --more-prompts and --self-prompts "
                       "must be >= 0"):
        distill(tmp_path / "draft", DistillConfig(**{setting: -1}))
    assert not (tmp_path / "draft").exists()


def test_export_verifies_the_head_restricted_draft(distilled_bundle):
    _, manifest = distilled_bundle
    report = manifest["verify"]["draft"]
    assert report["ok"] and report["greedy_matches"] == 32


def test_draft_gives_zero_probability_outside_its_head(distilled, distilled_bundle):
    from specedge.runtime.backends.ort_cpu import OrtCpuBackend
    from specedge.runtime.bundle import load_bundle

    out, _ = distilled_bundle
    backend = OrtCpuBackend(load_bundle(out).draft)
    logits = backend.forward(backend.new_cache(8), [1, 5, 6], 3)
    head = json.loads((distilled[0] / DRAFT_META).read_text())["head_token_ids"]
    outside = np.setdiff1d(np.arange(logits.shape[1]), head)
    assert np.isneginf(logits[:, outside]).all()
    assert np.isfinite(logits[:, head]).all()


def test_greedy_speculative_equals_plain(distilled_bundle):
    gen = Generator.from_bundle(distilled_bundle[0])
    for prompt in ("hello world", "the cat sat", "why?"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=40, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=40, draft_tokens=4,
                            drafter="model")
        assert spec.token_ids == plain.token_ids


def test_sampling_with_a_partial_head_is_exact(distilled_bundle):
    """Two-sample chi-square (N = 1500 per arm, alpha = 0.001, seeds 0.. and 10000..) on
    the joint of the first two tokens: the draft gives q = 0 to tokens outside its head,
    so the residual must supply them."""
    gen = Generator.from_bundle(distilled_bundle[0])
    plain = first_two_tokens(gen, 1500, 0, use_draft=False, temperature=1.0)
    spec = first_two_tokens(gen, 1500, 10_000, draft_tokens=2, temperature=1.0,
                            drafter="model")
    assert two_sample_pvalue(plain, spec) > 0.001


def test_draft_for_another_tokenizer_is_refused(distilled, tmp_path):
    other = save_tiny(tmp_path / "other", "llama", other_ids=True)
    with pytest.raises(ValueError, match="distilled for another tokenizer"):
        export_bundle(str(other), tmp_path / "b", draft=str(distilled[0]))
    assert not (tmp_path / "b").exists()


def test_a_narrower_mlp_keeps_the_neurons_that_carry_the_layer(tiny_checkpoints):
    """With all but 16 of the target layer's 64 MLP neurons silenced, a 16-neuron copy must
    keep exactly the live ones: its layer computes what the target's does."""
    from specedge.export.drafts.truncated import make_draft

    target, _ = load_model(tiny_checkpoints["llama"])
    mlp = target.model.layers[0].mlp
    live = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:16]
    with torch.no_grad():
        silent = torch.ones(64, dtype=torch.bool)
        silent[live] = False
        mlp.down_proj.weight[:, silent] = 0.0
        # The live neurons' up rows are made smaller than the silent ones': only the norms
        # of down's columns tell them apart.
        mlp.up_proj.weight[live] *= 0.01
    draft = make_draft(target, 1, mlp_width=16)
    assert draft.model.layers[0].mlp.down_proj.weight.shape == (32, 16)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.allclose(draft.model.layers[0].mlp(x), mlp(x), atol=1e-6)
    with pytest.raises(ValueError, match=r"--mlp-width must be in \[1, 64\]"):
        make_draft(target, 1, mlp_width=65)


@pytest.mark.parametrize("which", ["distilled", "feature_draft"])
def test_a_narrower_draft_trains_exports_and_is_exact(which, request, tiny_checkpoints,
                                                      tmp_path):
    """--mlp-width on a finished run's data: the draft folder stores the narrower MLP, and
    its bundle verifies against torch and decodes exactly (greedy)."""
    import shutil

    out, cfg, _ = request.getfixturevalue(which)
    copy = tmp_path / "draft"
    shutil.copytree(out, copy)
    meta = distill(copy, DistillConfig(**{**cfg.__dict__, "epochs": 1, "mlp_width": 24}))
    weights = load_file(str(copy / DRAFT_WEIGHTS))
    down = [w for k, w in weights.items() if k.endswith("mlp.down_proj.weight")]
    assert down and all(w.shape == (32, 24) for w in down)
    assert meta["mlp_width"] == 24
    manifest = export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "bundle",
                             draft=str(copy), verify=True)
    assert manifest["verify"]["draft"]["ok"]
    gen = Generator.from_bundle(tmp_path / "bundle")
    plain = gen.generate("the cat sat", raw=True, max_new_tokens=24, use_draft=False)
    spec = gen.generate("the cat sat", raw=True, max_new_tokens=24, draft_tokens=2,
                        drafter="model")
    assert spec.token_ids == plain.token_ids and spec.stats["drafted_tokens"] > 0


def test_a_run_from_before_mlp_width_resumes(distilled, tmp_path):
    """A training state saved before a setting existed reads it as its default."""
    import shutil

    out, cfg, _ = distilled
    copy = tmp_path / "draft"
    shutil.copytree(out, copy)
    settings = json.loads((copy / "work" / "settings.json").read_text())
    del settings["mlp_width"]
    (copy / "work" / "settings.json").write_text(json.dumps(settings))
    state = (copy / "work" / "train.pt").stat().st_mtime_ns
    distill(copy, cfg)
    assert (copy / "work" / "train.pt").stat().st_mtime_ns == state


def test_mlp_width_beyond_the_targets_is_refused_before_any_answer(tiny_checkpoints,
                                                                   tmp_path):
    cfg = DistillConfig(target=str(tiny_checkpoints["llama"]), prompts=4, new_tokens=4,
                        mlp_width=0)
    with pytest.raises(ValueError, match="--mlp-width must be in"):
        distill(tmp_path / "d", cfg)
    assert not list((tmp_path / "d" / "work").glob("data-*.pt"))


def test_varied_prompts_mix_questions_summaries_and_code():
    from specedge.export.distill.prompts import varied_prompts

    passages = [f"Passage number {i} says something. " * 8 for i in range(10)]
    prompts = varied_prompts(30, 0, passages)
    assert len(prompts) == len(set(prompts)) == 30
    assert sum(p.startswith("Summarize the following passage") for p in prompts) == 10
    assert sum(p.startswith("Write a ") and " function that " in p for p in prompts) == 10
    assert varied_prompts(30, 0, passages) == prompts != varied_prompts(30, 1, passages)
    with pytest.raises(ValueError, match="at most"):
        varied_prompts(10_000, 0, passages)


def test_passages_are_the_targets_answers_cut_at_a_full_stop():

    from specedge.export.distill.prompts import passages_from

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    text = "A long answer. " * 20 + "cut here"
    ids = [ord(c) for c in "prompt"] + [ord(c) for c in text]
    ex = {"ids": torch.tensor(ids), "start": 5}
    short = {"ids": torch.tensor([ord(c) for c in "prompt" + "Too short."]), "start": 5}
    assert passages_from([ex, short], Chars()) == [("A long answer. " * 20).strip()]


def test_init_starts_training_from_a_draft_folder(distilled, tmp_path):
    """`--init DIR`: the new draft holds DIR's weights before training (the head tokens
    chosen again), and one epoch from there ends better than one epoch from scratch."""
    out, cfg, _ = distilled
    target, tokenizer = load_model(cfg.target)
    warm = replace(cfg, init=str(out), epochs=1)
    draft = new_draft(target, warm, torch.arange(3, 3 + HEAD))
    trained = load_draft(out, target, tokenizer).state_dict()
    own = [k for k in trained if not is_target_part(k)]
    assert own and all(torch.equal(draft.state_dict()[k], trained[k]) for k in own)
    assert torch.equal(draft.specedge_head_ids, torch.arange(3, 3 + HEAD))
    from_init = distill(tmp_path / "warm", warm)["report"]["val_loss"]
    from_scratch = distill(tmp_path / "cold", replace(cfg, epochs=1))["report"]["val_loss"]
    assert from_init < from_scratch


def test_init_of_another_shape_is_refused_before_any_answer(distilled, tmp_path):
    out, cfg, _ = distilled
    with pytest.raises(ValueError, match="another shape"):
        distill(tmp_path / "d", replace(cfg, layers=2, init=str(out)))
    assert not list((tmp_path / "d" / "work").glob("data-*.pt"))
