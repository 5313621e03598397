"""Target-written prompts (export/distill/self_prompts.py): which continuations make requests, and
`specedge distill --self-prompts` on a tiny target."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import SPECIALS, VOCAB, save_tiny

from specedge.export.distill.config import DistillConfig
from specedge.export.distill.self_prompts import (
    bench_requests,
    close_to,
    content_words,
    pick_requests,
    turn_markers,
)
from specedge.export.distill.train import distill

END = "<|im_end|>"


def test_pick_requests_keeps_whole_new_requests_in_order():
    continuations = [
        "How do volcanoes form?<|im_end|>\n<|im_start|>",
        "Explain how tides work and why they change through the",  # out of tokens
        "  how do VOLCANOES   form?  <|im_end|>",  # the first again
        "Hi<|im_end|>",  # too short
        "What is <|im_start|>system<|im_end|>",  # a special token inside
        "What is a good name for a pet goldfish?<|im_end|>",
        "Plan a weekend trip to the mountains.<|im_end|>",
    ]
    picked = pick_requests(continuations, END, ["<|im_start|>", END], [], 10)
    assert picked == ["How do volcanoes form?", "What is a good name for a pet goldfish?",
                      "Plan a weekend trip to the mountains."]
    assert pick_requests(continuations, END, ["<|im_start|>", END], [], 2) == picked[:2]


def test_requests_close_to_a_bench_prompt_are_dropped():
    bench = ["Why is the ocean salty?", "Write a Python function that checks whether a "
             "string is a palindrome."]
    assert content_words(bench[1]) == {"checks", "whether", "string", "palindrome"}
    words = [content_words(b) for b in bench]
    assert close_to("Why is the ocean water so salty?", words)
    assert close_to("Write a function to test if a string is a palindrome", words)
    assert not close_to("Why is the sky blue?", words)
    assert not close_to("Write a Python function that reverses a string.", words)
    picked = pick_requests(["Why is the ocean so salty?<|im_end|>",
                            "Why is the sky blue?<|im_end|>"], END, [], bench, 2)
    assert picked == ["Why is the sky blue?"]


WORDS = ("the cat dog sun tree blue runs jumps over under big small red fast slow happy sad "
         "old new green bird fish moon star rain wind song book door road hill").split()


@pytest.fixture(scope="module")
def word_target(tmp_path_factory):
    """A tiny Llama on a one-token-per-word vocabulary whose chat template ends a user turn
    with "road", a word it writes often: some of its continuations of a bare user turn are
    requests. Its <unk> and <s> rows are shrunk, as `save_tiny` does EOS's, so that they
    seldom cut a request short."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = save_tiny(tmp_path_factory.mktemp("words") / "llama")
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    assert len(vocab) == len(VOCAB)  # the model's vocabulary size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['content'] }} road{% endfor %}"
                          "{% if add_generation_prompt %}<s>{% endif %}")
    fast.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight[:2] *= 0.2
    model.save_pretrained(path)
    return path


def test_turn_markers(word_target):
    from transformers import AutoTokenizer

    assert turn_markers(AutoTokenizer.from_pretrained(word_target)) == ("<s>", "road")


def test_distill_answers_the_target_written_requests_last(word_target, tmp_path):
    """Data made without --self-prompts keeps its shards when they are added; the requests
    are sampled once and cached, and their answers come in shards after the others."""
    from transformers import AutoTokenizer

    cfg = DistillConfig(target=str(word_target), layers=1, head_tokens=16, prompts=16,
                        new_tokens=8, generate_batch=8, epochs=1, batch=8)
    distill(tmp_path, cfg)
    work = tmp_path / "work"
    shards = {p.name: p.stat().st_mtime_ns for p in work.glob("data-*.pt")}
    assert sorted(shards) == ["data-0000.pt", "data-0001.pt"]
    grown = DistillConfig(**{**cfg.__dict__, "self_prompts": 10})
    distill(tmp_path, grown)
    now = {p.name: p.stat().st_mtime_ns for p in work.glob("data-*.pt")}
    assert {k: now[k] for k in shards} == shards
    assert sorted(set(now) - set(shards)) == ["data-0002.pt", "data-0003.pt"]
    raw = [t for p in sorted(work.glob("requests-*.json")) for t in json.loads(p.read_text())]
    requests = pick_requests(raw, "road", SPECIALS, bench_requests(), 10)
    assert len(requests) == 10 and len(set(requests)) == 10
    assert all(len(r.split()) >= 3 and "<" not in r for r in requests)
    tok = AutoTokenizer.from_pretrained(word_target)
    asked = [ex["ids"][:ex["start"] + 1].tolist()
             for name in ("data-0002.pt", "data-0003.pt") for ex in torch.load(work / name)]
    assert asked == [tok(f"<s>{r} road<s>", add_special_tokens=False)["input_ids"]
                     for r in requests]
    cached = {p.name: p.stat().st_mtime_ns for p in work.glob("requests-*.json")}
    distill(tmp_path, grown)  # resumes: nothing sampled again
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("requests-*.json")} == cached
    with pytest.raises(ValueError, match="data generated with other settings"):
        distill(tmp_path, DistillConfig(**{**grown.__dict__, "more_prompts": 8}))


def test_a_target_that_never_ends_a_turn_is_told_to_ask_for_fewer(tiny_checkpoints, tmp_path):
    """The tiny tokenizer has no newline, so its template's user turns never end."""
    cfg = DistillConfig(target=str(tiny_checkpoints["llama"]), layers=1, head_tokens=16,
                        prompts=8, new_tokens=4, generate_batch=8, epochs=1, self_prompts=2)
    with pytest.raises(ValueError, match="wrote only 0 usable requests in 8 tries; ask for "
                       "fewer --self-prompts"):
        distill(tmp_path, cfg)
