"""`specedge serve` against hostile and careless clients, on the real server process: text
that is not Unicode, oversized and endless headers, slow bodies, too many connections,
clients leaving mid-body, forged log lines, huge stop lists, pages on other sites and DNS
rebinding, HTTP/1.0 streams, 405's Allow, and a second SIGTERM during the drain.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, run_server
from tiny_models import export_slow_bundle

from specedge.runtime.config import MAX_STOP_STRINGS
from specedge.runtime.generator import Generator
from specedge.serve.origins import host_allowed, origin_allowed


@pytest.fixture(scope="module")
def limited_server(tiny_bundle, tmp_path_factory) -> Iterator[ServerProcess]:
    """The tiny bundle with 1 s for headers and for a body, one site allowed to call it
    from its pages, and room for 32 connections."""
    with run_server(tiny_bundle, tmp_path_factory.mktemp("serve-limits"), "--model-name",
                    "tiny", "--header-timeout", "1", "--body-timeout", "1",
                    "--allowed-origins", "http://app.example:3000",
                    "--max-connections", "32") as server:
        yield server


def raw(server: ServerProcess, data: bytes, timeout: float = 10) -> bytes:
    """Send `data` on a new connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def post_bytes(server: ServerProcess, path: str, body: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=body, timeout=30,
                      headers={"content-type": "application/json"})


def requests_total(server: ServerProcess, endpoint: str, status: int) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    key = f'specedge_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    return next((float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith(key)), 0.0)


# ---- text that is not Unicode ----------------------------------------------------------------

SURROGATE_BODIES = [
    ("/v1/completions", b'{"prompt": "ab\\ud800", "max_tokens": 2}', "character 2"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udcff"}], "max_tokens": 2}',
     "message 0's content is not valid text: character 0"),
    ("/tokenize", b'{"prompt": "x\\udfff"}', "character 1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": 2, "stop": ["\\ud800"]}', "stop string 0 is not valid text"),
]


@pytest.mark.parametrize("path,body,where", SURROGATE_BODIES)
def test_a_lone_surrogate_is_a_400_naming_its_position(limited_server, path, body, where):
    """A JSON escape of a lone UTF-16 surrogate: 400 with a message naming the character,
    counted in /metrics, no traceback in the log, and the same keep-alive connection then
    serves a good request."""
    before = requests_total(limited_server, path, 400)
    with httpx.Client(base_url=limited_server.url, timeout=30) as http:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert where in r.json()["error"]["message"], r.json()
        ok = http.post("/tokenize", json={"prompt": "fine"})
        assert ok.status_code == 200 and ok.json()["count"] >= 1
        assert ok.extensions["network_stream"] is not None
    assert requests_total(limited_server, path, 400) == before + 1
    assert "Traceback" not in limited_server.output()


def test_invalid_text_in_the_python_api_is_a_value_error(tiny_bundle):
    gen = Generator.from_bundle(tiny_bundle, threads=1)
    with pytest.raises(ValueError, match="character 0 is '\\\\udcff', a lone surrogate"):
        gen.generate("\udcff", max_new_tokens=2)
    with pytest.raises(ValueError, match="message 1's content"):
        gen.generate(messages=[{"role": "user", "content": "a"},
                               {"role": "user", "content": "b\ud800"}], max_new_tokens=2)


@pytest.mark.parametrize("flags", [[], ["--raw"], ["--json"]])
def test_invalid_utf8_on_the_command_line_exits_2(tiny_bundle, flags):
    """`--prompt` of bytes that are not UTF-8 (Python sees them as lone surrogates): exit
    2 with the message, no traceback."""
    r = subprocess.run([sys.executable, "-m", "specedge.cli", "generate", "--bundle",
                        str(tiny_bundle), "--prompt", b"ok \xff", "--max-new-tokens", "2",
                        *flags], capture_output=True, timeout=120)
    stderr = r.stderr.decode(errors="replace")
    assert r.returncode == 2, stderr
    assert "character 3" in stderr and "lone surrogate" in stderr
    assert "Traceback" not in stderr


# ---- headers, bodies and connections ---------------------------------------------------------

def test_oversized_headers_are_refused_without_holding_memory(limited_server):
    """20 KB of headers (over the 16 KiB default) sent at once, and 20 KB sent in pieces,
    get 431 and a closed connection; two unfinished 8 MB header blocks held open cost the
    server no more than a few MB."""
    head = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n"
    big = b"".join(b"x-pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(20))
    answer = raw(limited_server, head + big + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    with socket.create_connection(("127.0.0.1", limited_server.port), timeout=10) as s:
        s.sendall(head)
        for i in range(0, len(big), 4000):
            s.sendall(big[i:i + 4000])
            time.sleep(0.02)
        assert read_all(s).startswith(b"HTTP/1.1 431")
    rss = limited_server.rss_mb()
    held = [socket.create_connection(("127.0.0.1", limited_server.port)) for _ in range(2)]
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")
            try:
                for _ in range(8):
                    s.sendall(b"x-pad: " + b"a" * (2**20) + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server closed it: what is wanted
        assert limited_server.rss_mb() - rss < 8
    finally:
        for s in held:
            s.close()
    assert httpx.get(limited_server.url + "/health", timeout=10).status_code == 200


def test_headers_sent_a_byte_at_a_time_are_cut_off(limited_server):
    """Slowloris: 20 connections sending a header byte every 0.2 s are answered 408 and
    closed after the 1 s header timeout, as are connections that send nothing; a normal
    request meanwhile is served."""
    conns = [socket.create_connection(("127.0.0.1", limited_server.port), timeout=5)
             for _ in range(20)]
    silent = socket.create_connection(("127.0.0.1", limited_server.port), timeout=5)
    start = time.monotonic()
    closed_at: dict[int, float] = {}
    try:
        for s in conns:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        while len(closed_at) < len(conns) and time.monotonic() - start < 6:
            for i, s in enumerate(conns):
                if i in closed_at:
                    continue
                try:
                    s.sendall(b"x")
                except (BrokenPipeError, ConnectionResetError):
                    closed_at[i] = time.monotonic() - start
            time.sleep(0.2)
        assert len(closed_at) == len(conns), closed_at
        assert all(0.8 < t < 3 for t in closed_at.values()), closed_at
        assert read_all(silent).startswith(b"HTTP/1.1 408")
        assert httpx.get(limited_server.url + "/health", timeout=10).status_code == 200
    finally:
        for s in [*conns, silent]:
            s.close()


def test_the_header_timeout_starts_again_for_each_request_of_a_connection(limited_server):
    """A kept-alive connection's first request is answered; its second, sent a header byte
    every 0.2 s, is cut off with 408 after the 1 s header timeout, as a first one is."""
    with socket.create_connection(("127.0.0.1", limited_server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)[1])
        while len(body) < length:
            body += s.recv(65536)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        start, closed = time.monotonic(), None
        s.settimeout(0.2)
        second = b""
        while closed is None and time.monotonic() - start < 6:
            try:
                s.sendall(b"x")
                chunk = s.recv(65536)
                second += chunk
                if not chunk:
                    closed = time.monotonic() - start
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = time.monotonic() - start
    assert second.startswith(b"HTTP/1.1 408"), second[:200]
    assert closed is not None and 0.8 < closed < 3, closed


def test_a_header_block_of_exactly_the_limit_is_read_and_one_byte_more_is_not(
        limited_server):
    """--max-header-bytes (16384 here) counts the request line and headers up to the blank
    line: exactly that many is a request, one more is 431."""
    def request(size: int) -> bytes:
        head = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-pad: "
        return head + b"a" * (size - len(head)) + b"\r\nconnection: close\r\n\r\n"

    line = len(b"\r\nconnection: close")
    assert raw(limited_server, request(16384 - line)).startswith(b"HTTP/1.1 200")
    assert raw(limited_server, request(16385 - line)).startswith(b"HTTP/1.1 431")


def test_a_body_sent_a_byte_a_second_gets_408(limited_server):
    """A body promised at 200 bytes and sent a byte at a time: 408 after the 1 s body
    timeout, in OpenAI's error shape."""
    with socket.create_connection(("127.0.0.1", limited_server.port), timeout=10) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                  b"application/json\r\ncontent-length: 200\r\n\r\n{")
        start = time.monotonic()
        answer = b""
        s.settimeout(0.3)
        while not answer and time.monotonic() - start < 5:
            try:
                s.sendall(b" ")
                answer = s.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        answered = time.monotonic()
        # The head and the body may come in two packets: read the body the head promises.
        head, _, body = answer.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        s.settimeout(2)
        while length and len(body) < int(length[1]):
            more = s.recv(65536)
            if not more:
                break
            body += more
        answer = head + b"\r\n\r\n" + body
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer.replace(b" ", b"")
    assert 0.8 < answered - start < 3


def test_connections_beyond_the_limit_get_503_and_the_rest_still_work(limited_server):
    """With 32 connections allowed and 31 held open (silent), a 33rd and 34th are answered
    503 and closed; once the header timeout closes the silent ones, requests work again."""
    held = [socket.create_connection(("127.0.0.1", limited_server.port)) for _ in range(31)]
    try:
        time.sleep(0.2)
        extra = [socket.create_connection(("127.0.0.1", limited_server.port), timeout=5)
                 for _ in range(3)]
        answers = [read_all(s) for s in extra]
        for s in extra:
            s.close()
        assert sum(a.startswith(b"HTTP/1.1 503") for a in answers) >= 2, answers
    finally:
        time.sleep(1.5)  # the header timeout closes the held ones
        for s in held:
            s.close()
    assert httpx.get(limited_server.url + "/health", timeout=10).status_code == 200
    assert "refusing a connection" in limited_server.output()


def test_the_connection_limit_is_exact(tiny_bundle, tmp_path):
    """--max-connections 4 on a server no earlier test used: with 3 held open, a 4th is
    taken (and, silent, cut off by the 3 s header timeout: 408) and a 5th gets 503."""
    with run_server(tiny_bundle, tmp_path, "--max-connections", "4",
                    "--header-timeout", "3") as server:  # the held ones stay past the 5th
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        try:
            time.sleep(0.3)
            fourth = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            time.sleep(0.3)
            fifth = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            answers = [read_all(s) for s in (fifth, fourth)]
            for s in (fourth, fifth):
                s.close()
        finally:
            for s in held:
                s.close()
    assert answers[0].startswith(b"HTTP/1.1 503"), answers
    assert answers[1].startswith(b"HTTP/1.1 408"), answers


def test_a_client_leaving_mid_body_logs_no_error(limited_server):
    with socket.create_connection(("127.0.0.1", limited_server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                  b"application/json\r\ncontent-length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.3)
    time.sleep(0.5)
    assert httpx.get(limited_server.url + "/health", timeout=10).status_code == 200
    output = limited_server.output()
    assert "ClientDisconnect" not in output and "Traceback" not in output
    assert "ERROR" not in output


def test_an_unknown_field_name_cannot_forge_a_log_line(limited_server):
    forged = "ERROR:     specedge.serve: forged line"
    r = httpx.post(limited_server.url + "/v1/completions", timeout=30, json={
        "prompt": "hi", "max_tokens": 2, "x\n" + forged: 1, "y\r\x1b[2J": 2})
    assert r.status_code == 200, r.text
    lines = limited_server.output().splitlines()
    assert not any(line.startswith(forged) for line in lines)
    assert any("ignoring unknown request fields" in line and "'x\\n" in line for line in lines)


# ---- stop strings ----------------------------------------------------------------------------

def test_stop_strings_are_bounded(limited_server):
    """200,000 stop strings (1.8 MB): a 400 at once, not a 30 s generation; 33 strings and
    a 257-character one are 400s too; 32 short ones are served."""
    url = limited_server.url + "/v1/completions"
    start = time.monotonic()
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 50,
                              "stop": [f"s{i:06d}" for i in range(200_000)]}, timeout=60)
    assert r.status_code == 400 and "at most 32" in r.json()["error"]["message"]
    assert time.monotonic() - start < 10
    too_many = [f"q{i}" for i in range(MAX_STOP_STRINGS + 1)]
    assert httpx.post(url, json={"prompt": "hi", "stop": too_many}, timeout=30
                      ).status_code == 400
    r = httpx.post(url, json={"prompt": "hi", "stop": ["z" * 257]}, timeout=30)
    assert r.status_code == 400 and "257 characters" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2,
                              "stop": too_many[:MAX_STOP_STRINGS]}, timeout=30)
    assert r.status_code == 200, r.text


# ---- web pages on other sites ----------------------------------------------------------------

def test_a_page_on_another_site_is_refused(limited_server):
    """A `text/plain` POST from a page on another origin (a browser sends it without a
    preflight): 403 origin_not_allowed, counted; the server's own origin and the allowed
    one are served; the allowed one's preflight gets CORS headers."""
    url = limited_server.url + "/v1/completions"
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    before = requests_total(limited_server, "/v1/completions", 403)
    r = httpx.post(url, content=body, timeout=30, headers={
        "content-type": "text/plain", "origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert requests_total(limited_server, "/v1/completions", 403) == before + 1
    for origin in (f"http://127.0.0.1:{limited_server.port}", "http://app.example:3000"):
        r = httpx.post(url, content=body, timeout=30, headers={
            "content-type": "application/json", "origin": origin})
        assert r.status_code == 200, (origin, r.text)
    r = httpx.options(url, timeout=30, headers={
        "origin": "http://app.example:3000", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type, authorization"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example:3000"
    r = httpx.options(url, timeout=30, headers={
        "origin": "http://evil.example", "access-control-request-method": "POST"})
    assert r.status_code == 403
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("host,status", [
    ("evil.example:8000", 403), ("127.0.0.1", 200), ("[::1]:8000", 200),
    ("localhost:8000", 200), ("192.168.1.20:8000", 200), (socket.gethostname(), 200)])
def test_dns_rebinding_host_names_are_refused(limited_server, host, status):
    """A Host that is not an IP address or this machine's own name (what a page whose name
    was re-pointed at the server sends) is 403 host_not_allowed."""
    r = httpx.get(limited_server.url + "/v1/models", headers={"host": host}, timeout=30)
    assert r.status_code == status, (host, r.text)
    if status == 403:
        assert r.json()["error"]["code"] == "host_not_allowed"


def test_host_and_origin_rules():
    own = {"localhost", "jetson", "jetson.local"}
    # Host names are case-insensitive (RFC 9110 4.2.3): a browser or a client may send any.
    assert host_allowed("LOCALHOST:8000", (), own) and host_allowed("Jetson.Local", (), own)
    assert host_allowed("API.Example.NET", (".example.net",), own)
    assert host_allowed("api.example.net", (".Example.Net",), own)
    assert not host_allowed("Jetson.Local.Evil.Example", (), own)
    assert origin_allowed("HTTP://127.0.0.1:8000", "127.0.0.1:8000", ())
    assert origin_allowed("https://App.Example", "x", ("https://app.example",))
    assert host_allowed("jetson.local:8000", (), own) and host_allowed("[fe80::1]:80", (), own)
    assert host_allowed("10.0.0.7", (), own) and host_allowed(None, (), own)
    assert not host_allowed("jetson.local.evil.example", (), own)
    assert not host_allowed("localhost.evil.example:8000", (), own)
    assert host_allowed("anything.example", ("*",), own)
    assert host_allowed("a.b.example.net", (".example.net",), own)
    assert not host_allowed("notexample.net", (".example.net",), own)
    assert origin_allowed(None, "127.0.0.1:8000", ())
    assert origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", ())
    assert not origin_allowed("http://127.0.0.1:8001", "127.0.0.1:8000", ())
    assert not origin_allowed("null", "127.0.0.1:8000", ())
    assert origin_allowed("https://app.example/", "127.0.0.1:8000", ("https://app.example",))
    assert not origin_allowed("https://app.example.evil", "x", ("https://app.example",))


def test_allowed_hosts_flag(tiny_bundle, tmp_path):
    with run_server(tiny_bundle, tmp_path, "--allowed-hosts", ".example.net") as server:
        for host, status in (("api.example.net", 200), ("example.net:80", 200),
                             ("badexample.net", 403)):
            r = httpx.get(server.url + "/health", headers={"host": host}, timeout=30)
            assert r.status_code == status, host


# ---- HTTP details ----------------------------------------------------------------------------

def test_a_stream_to_an_http_1_0_client_is_not_chunked(limited_server):
    body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()
    answer = raw(limited_server, b"POST /v1/completions HTTP/1.0\r\nhost: 127.0.0.1\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(body), body))
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding" not in head.lower()
    assert payload.startswith(b"data: {") and payload.endswith(b"data: [DONE]\n\n"), payload


def test_a_full_context_error_names_only_what_the_client_sent(limited_server):
    """Without max_tokens, a prompt that fills the context is reported as that, not as a
    max_tokens the client never sent."""
    url = limited_server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "z" * 600}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "leaves no room for an answer" in error["message"]
    assert "max_tokens" not in error["message"]
    r = httpx.post(url, json={"prompt": "z" * 600, "max_tokens": 3}, timeout=30)
    assert "max_tokens (3)" in r.json()["error"]["message"]


def test_405_says_which_methods_the_path_takes(limited_server):
    r = httpx.get(limited_server.url + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405
    assert "POST" in r.headers["allow"]
    assert r.json()["error"]["message"]


# ---- a second SIGTERM ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_bundle(tmp_path_factory) -> Path:
    return export_slow_bundle(tmp_path_factory.mktemp("slow-limits"), 2048)


@pytest.mark.parametrize("run", range(3))
def test_a_second_sigterm_ends_the_streams_with_an_error_and_exits_0(slow_bundle, tmp_path,
                                                                     run):
    """Two long streams (one running, one queued), SIGTERM, then SIGTERM again during the
    drain: both streams end with the shutting_down error event and [DONE], the process
    exits 0 (not an abort), well before the 30 s shutdown timeout."""
    with run_server(slow_bundle, tmp_path, "--model-name", "slow") as server:
        events: dict[int, list] = {0: [], 1: []}

        def stream(i: int) -> None:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                    "prompt": f"long {i}", "max_tokens": 1900, "temperature": 0,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events[i].append(line[6:])

        threads = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        while not events[0]:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(20) == 0, server.output()
        assert time.monotonic() - signalled < 10
        for t in threads:
            t.join(10)
        for i in (0, 1):
            assert events[i][-1] == "[DONE]", (i, events[i][-3:])
            assert json.loads(events[i][-2])["error"]["code"] == "shutting_down", events[i][-3:]
        assert "terminate called" not in server.output()
