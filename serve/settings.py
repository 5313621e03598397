"""`specedge serve`'s settings: what the app runs with (`ServerSettings`) and what one client
connection may hold (`ConnectionLimits`). Each checks its own ranges when it is made, so that
every way of making them (the command line's flags, whose defaults are read from here, or a
`serve deploy` config through the cluster's `app_builder`) gets the same checks. Light to
import: the command line's parser reads the defaults without the serve extra."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specedge.runtime.config import (
    DEFAULT_DRAFTER,
    DEFAULT_SPINNING,
    check_threads,
    check_threshold,
)


@dataclass(frozen=True)
class ServerSettings:
    """`specedge serve`'s settings (its flags, in cli.py, take their defaults from here)."""

    bundle: str
    backend: str = "ort-cpu"
    threads: int | None = None
    spinning: bool | str = DEFAULT_SPINNING  # CPU threads spin while they wait: on, off, auto
    model_name: str | None = None        # default: the bundle folder's name
    api_key: str | None = None           # None: no key asked for
    max_queue: int = 32                  # requests waiting beyond the running ones
    max_batch: int = 1                   # requests generated at once (runtime/batch.py)
    prompt_cache_mb: int = 256           # store of earlier prompts' rows (MiB)
    request_timeout: float = 600.0       # seconds from arrival to the last token
    shutdown_timeout: float = 30.0       # seconds SIGTERM waits for in-flight requests
    draft_tokens: int | str | None = None  # a request's K unless it sets its own
    drafter: str = DEFAULT_DRAFTER
    draft_threshold: float = 0.0         # a request's draft_threshold unless it sets its own
    max_body_bytes: int = 2 * 2**20
    max_messages: int = 512
    max_tokens: int = 4096               # the most tokens one request may ask for
    keepalive: float = 15.0              # SSE comment after this many silent seconds
    stall_timeout: float = 120.0         # /health: 503 when no token for this long
    body_timeout: float = 30.0           # seconds for a request body to arrive
    allowed_hosts: tuple[str, ...] = ()  # Host names beyond this machine's (origins.py)
    allowed_origins: tuple[str, ...] = ()  # web pages on other sites that may call the API
    ui: bool = True                      # GET / answers the chat page (page.py)

    def __post_init__(self) -> None:
        """The ranges, checked however the settings are made (`specedge serve`'s flags, a
        `serve deploy` config): ValueError naming the setting and its flag."""
        for name in ("max_queue", "max_batch", "max_tokens", "max_messages", "max_body_bytes"):
            _check_count(name, getattr(self, name), 1)
        _check_count("prompt_cache_mb", self.prompt_cache_mb, 0)
        for name in ("request_timeout", "shutdown_timeout", "keepalive", "stall_timeout",
                     "body_timeout"):
            _check_seconds(name, getattr(self, name))
        check_threads(self.threads)
        check_threshold(self.draft_threshold)

    @property
    def name(self) -> str:
        return self.model_name or Path(self.bundle).resolve().name


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may hold (connections.py), its flags in cli.py."""

    max_connections: int = 256     # open at once; below the usual 1024 file descriptors
    header_timeout: float = 10.0   # seconds for a request line and its headers
    max_header_bytes: int = 16384  # a request line and its headers together

    def __post_init__(self) -> None:
        _check_count("max_connections", self.max_connections, 1)
        _check_count("max_header_bytes", self.max_header_bytes, 1)
        _check_seconds("header_timeout", self.header_timeout)


def _flag(name: str) -> str:
    """A setting as both its field and its flag: `max_queue (--max-queue)`."""
    return f"{name} (--{name.replace('_', '-')})"


def _check_count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{_flag(name)} must be an integer >= {least}, got {value!r}")


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{_flag(name)} must be > 0 seconds, got {value!r}")
