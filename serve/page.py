"""`GET /`: the chat page of `specedge serve` (page.html), one file with its style and
script inline, so that it works on a device with no network beyond this server.

The page holds no data of the server's: like /health it is answered without a key, and
everything it shows comes through the API (/v1/models, /v1/chat/completions) with the key
typed into it, under the API's own key, Host and Origin rules. It asks for each token's
kind with `speculative.marks` (pieces.py, protocol.piece_marks) to show which tokens the
target accepted from the draft.

Its Content-Security-Policy lets it run only its own inline style and script (by their
SHA-256), talk only to this server, and be framed by no other page.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@cache
def page() -> tuple[bytes, dict[str, str]]:
    """The page's bytes and the headers it is served with."""
    html = resources.files("specedge.serve").joinpath("page.html").read_text("utf-8")
    styles = re.findall(r"<style>(.*?)</style>", html, re.S)
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    policy = "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(map(_sha256, scripts)),
        "style-src " + " ".join(map(_sha256, styles)),
        "img-src data:", "connect-src 'self'", "base-uri 'none'", "form-action 'none'",
        "frame-ancestors 'none'",
    ])
    headers = {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
    return html.encode(), headers


def chat_page(request: Request) -> Response:
    body, headers = page()
    return Response(body, media_type="text/html; charset=utf-8", headers=headers)
