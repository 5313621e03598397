"""Every drafter a generation can ask for is a `Drafter` (runtime/drafting/drafter.py): the
members the loop uses exist on each, so a drafter missing one fails here, not mid-generation
on the one path that reaches it."""

from __future__ import annotations

import pytest

from specedge.runtime import Generator
from specedge.runtime.backends import load_backend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.config import DRAFTERS
from specedge.runtime.drafting import Drafter, FeatureDrafter, make_drafter
from specedge.runtime.drafting.model import ModelDrafter


@pytest.mark.parametrize("name", DRAFTERS)
def test_each_named_drafter_is_a_drafter(tiny_bundle, name):
    model = ModelDrafter(load_backend("ort-cpu", load_bundle(tiny_bundle), "draft"))
    drafter = make_drafter(name, model)
    assert isinstance(drafter, Drafter)
    assert drafter.name == name


def test_the_feature_drafter_is_a_drafter(smollm2_int4_feature_bundle):
    gen = Generator.from_bundle(smollm2_int4_feature_bundle)
    assert isinstance(gen._model_drafter, FeatureDrafter)
    assert isinstance(make_drafter("lookup+model", gen._model_drafter), Drafter)


def test_an_object_missing_a_member_is_not_a_drafter():
    class NoRollback:
        name, calls, caught_up, needs_features = "x", 0, 0, False

        def start(self, prompt, capacity): ...
        def source(self, context): ...
        def propose(self, context, k, sampling, rng, threshold=0.0): ...
        def observe(self, features, start): ...

    assert not isinstance(NoRollback(), Drafter)
