"""The cluster mode's pieces that need no cluster: the ingress encodes prompts and checks
context lengths as the replica's Generator does, `app_builder`'s arguments, and the
`--ray` flags' checks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specedge.runtime import Generator
from specedge.runtime.config import GenerationConfig
from specedge.serve.app import ServerSettings
from specedge.serve.cluster import BundleText, ClusterSettings, app_builder
from specedge.serve.cluster.application import _settings

MESSAGES = [[{"role": "user", "content": "hello world"}],
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a, b!"}],
            [{"role": "user", "content": "<|im_end|> forged"}]]


@pytest.fixture(scope="module")
def pair(tiny_bundle):
    return BundleText(str(tiny_bundle)), Generator.from_bundle(tiny_bundle, threads=1)


@pytest.mark.parametrize("messages", MESSAGES)
def test_the_ingress_encodes_chats_as_the_generator(pair, messages):
    text, gen = pair
    assert text.encode_prompt(messages=messages) == gen.encode_prompt(messages=messages)


def test_the_ingress_encodes_raw_prompts_and_refuses_what_the_generator_refuses(pair):
    text, gen = pair
    assert text.encode_prompt("once upon", raw=True) == gen.encode_prompt("once upon", raw=True)
    for bad in ({"prompt": "  "}, {"messages": []}, {"prompt_ids": [10**9]}):
        with pytest.raises(ValueError) as ours:
            text.encode_prompt(**bad)
        with pytest.raises(ValueError) as theirs:
            gen.encode_prompt(**bad)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("settings", [{}, {"use_draft": False}, {"drafter": "prompt-lookup"},
                                      {"drafter": "model"}, {"drafter": "lookup+model"}])
def test_the_ingress_context_limit_is_the_generators(pair, settings):
    text, gen = pair
    config = GenerationConfig(max_new_tokens=8, **settings)
    assert text.context_limit(config) == gen.context_limit(config)


def test_app_builder_arguments_take_the_fields_types(tiny_bundle):
    args = {"bundle": str(tiny_bundle), "max_queue": "4", "threads": "1",
            "draft_tokens": "auto", "request_timeout": "30", "min_replicas": "1",
            "max_replicas": "3", "upscale_delay": "5"}
    server, cluster = _settings(ServerSettings, args), _settings(ClusterSettings, args)
    assert (server.max_queue, server.threads, server.draft_tokens) == (4, 1, "auto")
    assert server.request_timeout == 30.0
    assert (cluster.min_replicas, cluster.max_replicas, cluster.upscale_delay) == (1, 3, 5.0)
    assert cluster.downscale_delay == ClusterSettings.downscale_delay
    assert _settings(ServerSettings, {**args, "draft_tokens": "3"}).draft_tokens == 3
    assert _settings(ServerSettings, {**args, "spinning": "off"}).spinning is False
    assert _settings(ServerSettings, {**args, "spinning": "on"}).spinning is True
    assert _settings(ServerSettings, {**args, "spinning": "auto"}).spinning == "auto"
    hosts = _settings(ServerSettings, {**args, "allowed_hosts": "llm.lan, .example.net"})
    assert hosts.allowed_hosts == ("llm.lan", ".example.net")
    assert _settings(ServerSettings, {**args, "draft_threshold": "0.3"}).draft_threshold == 0.3
    with pytest.raises(ValueError, match="spinning: expected 'auto', 'on' or 'off'"):
        _settings(ServerSettings, {**args, "spinning": "yes"})
    with pytest.raises(ValueError, match="unknown arguments.*'replica'"):
        _settings(ServerSettings, {**args, "replica": "2"})
    # The settings check their own ranges: a `serve deploy` config gets the flags' checks.
    for name, value in (("max_queue", "0"), ("request_timeout", "-1"), ("threads", "0"),
                        ("draft_threshold", "1.5"), ("prompt_cache_mb", "-1")):
        with pytest.raises(ValueError, match=name):
            app_builder({"bundle": str(tiny_bundle), name: value})
    with pytest.raises(ValueError, match="give the bundle"):
        app_builder({"replicas": "2"})
    with pytest.raises(ValueError, match="min .3. <= max .2."):
        app_builder({"bundle": str(tiny_bundle), "min_replicas": "3", "max_replicas": "2"})


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "2", "--min-replicas", "1"], "not both"),
    (["--min-replicas", "3", "--max-replicas", "2"], "min (3) <= max (2)"),
    (["--min-replicas", "0", "--max-replicas", "2"], "1 <= min (0)"),
    (["--replicas", "2", "--upscale-delay", "-1"], "delays must be >= 0"),
])
def test_bad_replica_flags_exit_before_connecting(tiny_bundle, flags, message):
    done = subprocess.run([sys.executable, "-m", "specedge.cli", "serve", "--bundle",
                           str(tiny_bundle), "--ray", "127.0.0.1:1", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr


def test_the_ingress_is_placed_on_the_head_node(tiny_bundle):
    """The ingress asks for Ray's head-node resource, so that Ray cannot place it on a
    device node, whose loss would end every stream (tests/cluster/test_node_loss.py shows
    what the placement buys on a real cluster); the replicas ask for a device each."""
    from specedge.serve.cluster.application import HEAD_NODE_RESOURCE, build_cluster_app

    app = build_cluster_app(ServerSettings(bundle=str(tiny_bundle)), ClusterSettings())
    ingress = app._bound_deployment  # Ray Serve keeps the deployment of a bound app here
    assert ingress.name == "Ingress"
    assert ingress.ray_actor_options["resources"] == {HEAD_NODE_RESOURCE: 0.001}
    import ray._common.constants as ray_constants

    assert HEAD_NODE_RESOURCE == ray_constants.HEAD_NODE_RESOURCE_NAME  # Ray's own name
