"""serve/settings.py: `specedge serve`'s settings check their own ranges however they are
made, and the flags' defaults are the settings' own."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from specedge.serve.cli import add_serve_arguments
from specedge.serve.settings import ConnectionLimits, ServerSettings


@pytest.mark.parametrize("field, value, says", [
    ("max_queue", 0, "max_queue (--max-queue) must be an integer >= 1, got 0"),
    ("max_batch", 1.5, "max_batch (--max-batch) must be an integer >= 1"),
    ("max_tokens", True, "max_tokens"),
    ("prompt_cache_mb", -1, "prompt_cache_mb (--prompt-cache-mb) must be an integer >= 0"),
    ("request_timeout", 0, "request_timeout (--request-timeout) must be > 0 seconds"),
    ("stall_timeout", -3.0, "stall_timeout"),
    ("threads", 0, "threads must be an integer"),
    ("draft_threshold", 1.0, "draft_threshold must be in [0, 1)"),
])
def test_server_settings_refuse_what_no_server_can_run(field, value, says):
    with pytest.raises(ValueError, match=r"^" + says.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        ServerSettings(bundle="b", **{field: value})


@pytest.mark.parametrize("field, value", [("max_connections", 0), ("header_timeout", 0),
                                          ("max_header_bytes", -5)])
def test_connection_limits_refuse_what_no_server_can_run(field, value):
    with pytest.raises(ValueError, match=field):
        ConnectionLimits(**{field: value})


def test_the_flags_defaults_are_the_settings_own():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--bundle", "b"])
    server, limits = ServerSettings(bundle="b"), ConnectionLimits()
    for f in fields(ServerSettings):
        if hasattr(args, f.name) and f.name not in ("bundle", "spinning"):
            flag = getattr(args, f.name)
            assert (tuple(flag) if isinstance(flag, list) else flag) == getattr(server, f.name)
    for f in fields(ConnectionLimits):
        assert getattr(args, f.name) == getattr(limits, f.name), f.name
