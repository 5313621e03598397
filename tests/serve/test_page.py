"""The chat page at `GET /`, driven in a real browser: Debian's headless Chromium under
Playwright, against the real server process on a slow random Llama behind an API key.
The page loads from the server alone with no console error, streams the answer the API
gives, marks each token as the API's marks say (and as many draft tokens as the
statistics count accepted), answers side by side with and without speculation, stops,
and shows a wrong key's error. Screenshots go to test-artifacts/ (or
$SPECEDGE_ARTIFACTS)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, run_server
from tiny_models import export_slow_bundle

from specedge.serve.app import ServerSettings, build_app

CHROMIUM = os.environ.get("SPECEDGE_CHROMIUM", "/usr/bin/chromium")
# As the machine's own Chromium runs headless, as root, with no network beyond loopback.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
KEY = "sk-page-" + secrets.token_hex(8)
# Not under build/: a wheel build (scripts/test_arm64.sh) clears that folder.
ARTIFACTS = Path(os.environ.get("SPECEDGE_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "test-artifacts"))
SPEC = {"drafter": "lookup+model", "draft_tokens": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("page")
    bundle = export_slow_bundle(tmp, 2048)
    (tmp / "key").write_text(KEY)
    with run_server(bundle, tmp, "--api-key-file", str(tmp / "key"),
                    "--model-name", "slow-llama") as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not shutil.which(CHROMIUM):
        pytest.fail(f"no Chromium at {CHROMIUM}: install Debian's chromium "
                    "(apt-get install chromium; scripts/test.sh does as root), or set "
                    "SPECEDGE_CHROMIUM to a Chromium binary")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


class Page:
    """A browser tab on the chat page, with what it logged and fetched."""

    def __init__(self, browser, server: ServerProcess, key: str | None = KEY,
                 width: int = 1100):
        self.context = browser.new_context(viewport={"width": width, "height": 900})
        if key is not None:  # typed into the page's settings before: kept for the tab
            self.context.add_init_script(
                f"sessionStorage.setItem('specedge.key', {json.dumps(key)});")
        self.tab = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.tab.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.tab.on("pageerror", lambda e: self.errors.append(str(e)))
        self.tab.on("request", lambda r: self.requests.append(r.url))
        self.tab.goto(server.url + "/")

    def settings(self, **values) -> None:
        self.tab.locator("#settings-box summary").click()
        for name, value in values.items():
            field = self.tab.locator(f"#{name}")
            if isinstance(value, bool):
                field.set_checked(value)
            elif field.evaluate("e => e.tagName") == "SELECT":
                field.select_option(str(value))
            else:
                field.fill(str(value))
        self.tab.locator("#settings-box summary").click()

    def send(self, text: str) -> None:
        self.tab.locator("#prompt").fill(text)
        self.tab.locator("#send").click()

    def answers(self):
        """The last turn's answer boxes (a Playwright locator)."""
        return self.tab.locator(".turn.assistant").last.locator(".answer")

    def wait_done(self, count: int = 1, timeout: float = 60) -> None:
        self.tab.locator(".turn.assistant").last.locator(
            ".answer[data-done=true]").nth(count - 1).wait_for(timeout=timeout * 1000)

    def close(self) -> None:
        self.context.close()


def api_stream(server: ServerProcess, messages: list, max_tokens: int) -> tuple[str, list, dict]:
    """The API's streamed answer to the page's request: text, marks and statistics."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "top_p": 1, "speculative": {**SPEC, "marks": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    marks = [m for e in events[:-1] for m in e.get("speculative", {}).get("marks", [])]
    return text, marks, events[-1]["speculative"]


def shot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.tab.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 1000
    return path


def test_the_page_is_small_self_contained_and_locked_down(server):
    r = httpx.get(server.url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert len(r.content) < 100_000, len(r.content)
    # Nothing fetched from elsewhere: the only absolute URL is SVG's namespace name.
    assert set(re.findall(r"https?://[^\s\"'`)]+", r.text)) == {"http://www.w3.org/2000/svg"}
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy
    # The page is open like /health, the API behind it is not.
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    # The Host rule of the API holds for the page too (DNS rebinding).
    assert httpx.get(server.url + "/", headers={"Host": "evil.example"},
                     timeout=10).status_code == 403


def test_no_ui_serves_the_api_alone(tmp_path):
    from starlette.testclient import TestClient

    client = TestClient(build_app(ServerSettings(bundle=str(tmp_path), ui=False)),
                        base_url="http://127.0.0.1")
    assert client.get("/").status_code == 404
    on = TestClient(build_app(ServerSettings(bundle=str(tmp_path))), base_url="http://127.0.0.1")
    assert on.get("/").status_code == 200


def test_a_chat_streams_the_apis_answer_with_its_marks(server, browser):
    page = Page(browser, server)
    try:
        page.tab.locator("#model").filter(has_text="slow-llama").wait_for(timeout=10_000)
        page.settings(max_tokens=48, drafter=SPEC["drafter"], k=SPEC["draft_tokens"])
        page.send("hello world")
        page.wait_done()
        answer = page.answers().first
        text, marks, stats = api_stream(server, [{"role": "user", "content": "hello world"}],
                                        48)
        assert answer.locator(".text").inner_text() == text
        spans = answer.locator(".text span")
        kinds = spans.evaluate_all("spans => spans.map(s => s.dataset.kind)")
        assert kinds == [kind for _, kind in marks]
        assert kinds.count("draft") + kinds.count("lookup") == stats["accepted_tokens"] > 0
        assert spans.evaluate_all("s => s.map(x => x.textContent).join('')") == text
        # One K bar and one acceptance bar per target call.
        assert answer.locator("svg.chart rect").count() == 2 * stats["target_calls"]
        assert f"target calls {stats['target_calls']}" in answer.locator(".stats").inner_text()
        # The conversation goes on with its history.
        page.send("and then?")
        page.wait_done()
        second, _, _ = api_stream(server, [
            {"role": "user", "content": "hello world"}, {"role": "assistant", "content": text},
            {"role": "user", "content": "and then?"}], 48)
        assert page.answers().first.locator(".text").inner_text() == second
        path = shot(page, "page-chat.png")
        print(f"screenshot: {path}")
        assert page.errors == []
        assert all(url.startswith(server.url + "/") for url in page.requests), page.requests
    finally:
        page.close()


def test_side_by_side_answers_are_equal_when_greedy(server, browser):
    page = Page(browser, server, width=390)  # a phone's width: the two answers stack
    try:
        page.settings(max_tokens=40, compare=True, drafter=SPEC["drafter"],
                      k=SPEC["draft_tokens"])
        page.send("a, b, c!")
        page.wait_done(count=2)
        verdict = page.tab.locator(".turn.assistant .verdict")
        verdict.wait_for()
        assert verdict.get_attribute("data-same") == "true"
        assert "the texts are equal" in verdict.inner_text()
        texts = page.answers().locator(".text").all_inner_texts()
        text, _, _ = api_stream(server, [{"role": "user", "content": "a, b, c!"}], 40)
        assert texts == [text, text]
        boxes = [page.answers().nth(i).bounding_box() for i in range(2)]
        assert boxes[1]["y"] >= boxes[0]["y"] + boxes[0]["height"]  # stacked
        assert page.tab.evaluate("document.documentElement.scrollWidth") <= 390
        shot(page, "page-side-by-side-phone.png")
        assert page.errors == []
    finally:
        page.close()


def test_stop_ends_the_answer_and_frees_the_server(server, browser):
    """Stop during a long answer: the text stops growing, the server stops generating
    (its /health counts no running request), and New clears the conversation."""
    page = Page(browser, server)
    try:
        page.settings(max_tokens=1900)
        page.send("tell me everything")
        text = page.answers().first.locator(".text")
        deadline = time.monotonic() + 30
        while len(text.inner_text()) < 10:
            assert time.monotonic() < deadline, "no text streamed"
            time.sleep(0.05)
        page.tab.locator("#stop").click()
        page.tab.locator("#send:enabled").wait_for(timeout=10_000)
        assert page.answers().first.locator(".stats").inner_text() == "stopped"
        stopped_at = text.inner_text()
        assert 10 <= len(stopped_at) < 1900
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).json()["running"]:
            assert time.monotonic() < deadline, "the server kept generating after the stop"
            time.sleep(0.1)
        assert text.inner_text() == stopped_at
        assert page.errors == [] and page.tab.locator("#error").inner_text() == ""
        page.tab.locator("#new").click()  # a new conversation: nothing of the old one
        assert page.tab.locator("#chat .turn").count() == 0
    finally:
        page.close()


def test_a_wrong_key_shows_the_servers_error(server, browser):
    page = Page(browser, server, key="sk-wrong")
    try:
        error = page.tab.locator("#error")
        error.filter(has_text="invalid or missing API key").wait_for(timeout=10_000)
        page.send("hello")
        page.tab.locator("#send:enabled").wait_for(timeout=10_000)
        assert "invalid or missing API key" in error.inner_text()
        assert page.answers().first.locator(".text").inner_text() == ""
    finally:
        page.close()


def test_on_a_keyed_server_the_page_asks_for_the_key_before_calling_the_api(server, browser):
    """Opened without a key, the page asks for one (/health says a key is required) and calls
    no key-guarded route meanwhile, so the console stays free of 401s; typed, the key
    brings the model's name."""
    assert httpx.get(server.url + "/health", timeout=10).json()["key_required"] is True
    page = Page(browser, server, key=None)
    try:
        page.tab.locator("#model").filter(has_text="enter the server's API key").wait_for(
            timeout=10_000)
        assert not any("/v1/" in url for url in page.requests), page.requests
        page.tab.locator("#key").fill(KEY)
        page.tab.locator("#key").dispatch_event("change")
        page.tab.locator("#model").filter(has_text="slow-llama").wait_for(timeout=10_000)
        assert page.errors == []
    finally:
        page.close()
