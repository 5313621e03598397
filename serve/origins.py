"""Which web pages may use the server: the Host and Origin checks of `specedge serve`.

A server on a device answers whoever reaches its port, and a web browser reaches it on a
page's behalf. Two ways for a page on another site to use it, which these checks close:

- A cross-site request. A browser sends a "simple" POST (`text/plain`, no custom header)
  without asking first, and the server runs it. Browsers mark every such request with an
  `Origin` header, so a request whose Origin is not the server's own (the scheme and the
  Host it was sent to) nor one of `--allowed-origins` is refused (403). Clients that are not
  browsers send no Origin and are not affected.
- DNS rebinding. A page on `evil.example` has that name re-resolved to 127.0.0.1 and then
  talks to the server as its own origin, reading the answers. Its requests carry
  `Host: evil.example`, so a Host that is not an IP address, `localhost`, this machine's
  name or one of `--allowed-hosts` is refused (403). A page served from an IP address is on
  that address, which is the server itself.

`--allowed-origins URL ...` also answers those origins' CORS preflights (Starlette's
CORSMiddleware), so that a web app elsewhere can call the API; `*` allows any.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from specedge.runtime.config import short_repr
from specedge.serve.protocol import APIError


def _host_name(host: str) -> str:
    """The name part of a Host header: without the port, IPv6 brackets removed, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def own_names() -> set[str]:
    """Names this machine goes by on its own: localhost, its host name, name.local (mDNS)."""
    names = {"localhost"}
    hostname = socket.gethostname().lower()
    if hostname:
        short = hostname.split(".")[0]
        names |= {hostname, short, f"{short}.local"}
    return names


def host_allowed(host: str | None, allowed: Sequence[str], own: set[str]) -> bool:
    """Whether a request's Host header names this server: an IP address, one of `own`, or
    one of `allowed` (a name, `.example.com` for it and its subdomains, or `*`)."""
    if "*" in allowed:
        return True
    if not host:
        return True  # HTTP/1.0 without Host: not a browser, which always sends one
    name = _host_name(host)
    if _is_ip(name) or name in own:
        return True
    for entry in allowed:
        entry = entry.lower()
        if name == entry or (entry.startswith(".") and
                             (name.endswith(entry) or name == entry[1:])):
            return True
    return False


def origin_allowed(origin: str | None, host: str | None, allowed: Sequence[str]) -> bool:
    """Whether a request from a page at `origin` may be answered: no Origin (not a browser
    page), the server's own origin (its host and port are the Host the request was sent
    to), or one of `allowed` (`scheme://host[:port]`, or `*`)."""
    if origin is None:
        return True
    # An origin is a scheme, a host and a port: case-insensitive throughout (RFC 6454).
    if "*" in allowed or origin.rstrip("/").lower() in [a.rstrip("/").lower()
                                                         for a in allowed]:
        return True
    parts = urlsplit(origin)
    return bool(host) and parts.scheme in ("http", "https") and \
        parts.netloc.lower() == host.strip().lower()


class OriginGuard:
    """ASGI middleware: 403 in OpenAI's error shape for a request from a foreign Host or a
    page on a foreign Origin (the module's docstring)."""

    def __init__(self, app, allowed_hosts: Sequence[str] = (),
                 allowed_origins: Sequence[str] = (),
                 refused: Callable[[str], None] = lambda path: None):
        self.app = app
        self.allowed_hosts = tuple(allowed_hosts)
        self.allowed_origins = tuple(allowed_origins)
        self.own = own_names()
        self.refused = refused  # told each refused request's path (the metrics count it)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host, origin = headers.get("host"), headers.get("origin")
        error = None
        if not host_allowed(host, self.allowed_hosts, self.own):
            error = APIError(403, f"the Host header {short_repr(host)} is not a name of this "
                             "server, as a web page re-pointing its own name here would "
                             "send; start the server with --allowed-hosts NAME to allow a "
                             "name", type="permission_error", code="host_not_allowed")
        elif not origin_allowed(origin, host, self.allowed_origins):
            error = APIError(403, f"requests from web pages on other sites are refused (Origin "
                             f"{short_repr(origin)}); start the server with "
                             "--allowed-origins ORIGIN to allow that site",
                             type="permission_error", code="origin_not_allowed")
        if error is None:
            return await self.app(scope, receive, send)
        self.refused(scope["path"])
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 403, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
