"""`specedge chat`: a conversation driven through piped stdin on the tiny bundle.

Replies are greedy, so each one must equal `Generator.generate(messages=...)` on the
conversation the chat should have sent: that checks the history it keeps, forgets, trims
and prefixes with the system message. The tiny bundle's character tokenizer has no newline,
so every reply is one line of stdout.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specedge.cli import main
from specedge.runtime import Generator
from specedge.runtime.bundle import MANIFEST

NEW_TOKENS = 24
SETTINGS = dict(max_new_tokens=NEW_TOKENS)  # the chat's defaults otherwise: greedy, auto K


@pytest.fixture(scope="module")
def api(tiny_bundle) -> Generator:
    return Generator.from_bundle(tiny_bundle)


def chat(monkeypatch, capsys, bundle: Path, stdin: str, *flags) -> tuple[int, str, str]:
    """Run `specedge chat` in-process with `stdin` piped in; (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    try:
        main(["chat", "--bundle", str(bundle), "--max-new-tokens", str(NEW_TOKENS),
              *map(str, flags)])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def reply(api: Generator, *messages: tuple[str, str]) -> str:
    return api.generate(messages=[{"role": r, "content": c} for r, c in messages],
                        **SETTINGS).text


def test_second_reply_sees_the_first_turn(monkeypatch, capsys, tiny_bundle, api):
    code, out, err = chat(monkeypatch, capsys, tiny_bundle, "hello there\nand then what\n")
    assert code == 0, err
    first = reply(api, ("user", "hello there"))
    second = reply(api, ("user", "hello there"), ("assistant", first), ("user", "and then what"))
    assert out == f"{first}\n{second}\n"
    # Without the history the model answers otherwise, so the check above can fail.
    assert second != reply(api, ("user", "and then what"))
    assert "Traceback" not in err


def test_reset_forgets_the_conversation(monkeypatch, capsys, tiny_bundle, api):
    code, out, err = chat(monkeypatch, capsys, tiny_bundle,
                          "hello there\n/reset\nand then what\n")
    assert code == 0, err
    assert out.splitlines() == [reply(api, ("user", "hello there")),
                                reply(api, ("user", "and then what"))]
    assert "conversation cleared" in err


def test_system_message_from_the_flag_and_the_command(monkeypatch, capsys, tiny_bundle, api):
    code, out, err = chat(monkeypatch, capsys, tiny_bundle,
                          "hello there\n/reset\n/system be short\nhello there\n",
                          "--system", "talk like a pirate")
    assert code == 0, err
    assert out.splitlines() == [
        reply(api, ("system", "talk like a pirate"), ("user", "hello there")),
        reply(api, ("system", "be short"), ("user", "hello there"))]
    assert "the system message stays" in err


def test_stats_command_prints_the_last_replys_statistics(monkeypatch, capsys, tiny_bundle):
    code, out, err = chat(monkeypatch, capsys, tiny_bundle, "/stats\nhello there\n/stats\n")
    assert code == 0, err
    assert len(out.splitlines()) == 1  # the statistics go to stderr, not among the replies
    before, after = err.split("\n", 1)
    assert "no statistics" in before
    assert "tokens per target call" in after and "acceptance" in after
    assert err.count("tokens per target call") == 1


def test_stats_flag_prints_statistics_after_every_reply(monkeypatch, capsys, tiny_bundle):
    code, out, err = chat(monkeypatch, capsys, tiny_bundle, "hello\nhow are you\n", "--stats")
    assert code == 0, err
    assert len(out.splitlines()) == 2
    assert err.count("tokens per target call") == 2
    assert err.count("decode, stop:") == 2


@pytest.mark.parametrize("command", ["/exit", "/quit"])
def test_exit_command_quits_with_status_0(monkeypatch, capsys, tiny_bundle, api, command):
    code, out, err = chat(monkeypatch, capsys, tiny_bundle,
                          f"hello there\n{command}\nnever sent\n")
    assert code == 0, err
    assert out.splitlines() == [reply(api, ("user", "hello there"))]


def test_help_lists_the_commands_and_sends_nothing(monkeypatch, capsys, tiny_bundle):
    code, out, err = chat(monkeypatch, capsys, tiny_bundle, "/help\n")
    assert code == 0 and out == "", err
    for command in ("/stats", "/reset", "/system TEXT", "/exit", "/help"):
        assert command in err, err
    assert "unknown command" not in err


def test_unknown_command_is_reported_not_sent(monkeypatch, capsys, tiny_bundle):
    code, out, err = chat(monkeypatch, capsys, tiny_bundle, "/stat\n")
    assert code == 0, err
    assert out == ""
    assert "unknown command /stat" in err and "/stats" in err


def test_bundle_without_chat_template_points_to_generate_raw(monkeypatch, capsys, tiny_bundle,
                                                             tmp_path):
    bundle = tmp_path / "no-template"
    shutil.copytree(tiny_bundle, bundle)
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["tokenizer"]["chat_template"] = None
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    (bundle / "chat_template.jinja").unlink()
    code, out, err = chat(monkeypatch, capsys, bundle, "hello\n")
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("specedge: error:")
    assert "no chat template" in lines[0] and "specedge generate --raw" in lines[0]


def test_history_over_the_context_drops_the_oldest_turns(monkeypatch, capsys, tiny_bundle,
                                                         api):
    # The tiny bundle's context is 512 tokens, one per character: two 250-character
    # messages do not fit, the second one alone (with the system message) does.
    assert api.bundle.target.max_context == 512
    first, second = "a" * 250, "b" * 250
    code, out, err = chat(monkeypatch, capsys, tiny_bundle, f"{first}\n{second}\n",
                          "--system", "be short")
    assert code == 0, err
    assert out.splitlines() == [reply(api, ("system", "be short"), ("user", first)),
                                reply(api, ("system", "be short"), ("user", second))]
    assert "dropped the oldest 1 turn" in err
    assert "Traceback" not in err


def test_message_too_long_for_the_context_is_refused_and_the_chat_goes_on(
        monkeypatch, capsys, tiny_bundle, api):
    code, out, err = chat(monkeypatch, capsys, tiny_bundle, f"{'a' * 600}\nhello there\n")
    assert code == 0, err
    assert out.splitlines() == [reply(api, ("user", "hello there"))]
    assert "exceeds the bundle's context of 512 tokens" in err


def test_ctrl_c_during_a_reply_stops_it_and_keeps_the_session(monkeypatch, capsys,
                                                              tiny_bundle, api):
    stream = Generator.stream
    closed = []

    class CtrlCAfterThreePieces:
        """The first reply's stream, with Ctrl-C arriving after its third piece."""

        def __init__(self, pieces):
            self.pieces, self.shown = pieces, 0

        def __iter__(self):
            return self

        def __next__(self):
            if self.shown == 3:
                raise KeyboardInterrupt
            self.shown += 1
            return next(self.pieces)

        def close(self):
            closed.append(True)
            self.pieces.close()

    def interrupted_once(self, *args, **kwargs):
        pieces = stream(self, *args, **kwargs)
        return pieces if closed else CtrlCAfterThreePieces(pieces)

    monkeypatch.setattr(Generator, "stream", interrupted_once)
    code, out, err = chat(monkeypatch, capsys, tiny_bundle, "hello there\nand then what\n")
    assert code == 0, err
    stopped, second = out.splitlines()
    full = reply(api, ("user", "hello there"))
    assert len(stopped) < len(full) and full.startswith(stopped)
    # What was shown of the stopped reply is the assistant's turn in the history.
    assert second == reply(api, ("user", "hello there"), ("assistant", stopped),
                           ("user", "and then what"))
    assert "reply stopped" in err
    assert closed == [True]  # the stopped stream was closed, so the generator is free


def test_ctrl_c_ends_a_reply_after_its_step_with_its_statistics(monkeypatch, capsys,
                                                                tiny_bundle, api):
    """A real SIGINT after the third piece: the reply ends after the step in progress
    (stop reason "cancelled"), says so, keeps what was shown in the history, and /stats
    describes it; the next reply goes on as usual."""
    stream = Generator.stream
    signalled = []

    def sigint_after_three_pieces(self, *args, **kwargs):
        for i, piece in enumerate(stream(self, *args, **kwargs)):
            yield piece
            if i == 2 and not signalled:
                signalled.append(True)
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Generator, "stream", sigint_after_three_pieces)
    code, out, err = chat(monkeypatch, capsys, tiny_bundle,
                          "hello there\n/stats\nand then what\n")
    assert code == 0, err
    stopped, second = out.splitlines()
    full = reply(api, ("user", "hello there"))
    assert len(stopped) < len(full) and full.startswith(stopped)
    assert second == reply(api, ("user", "hello there"), ("assistant", stopped),
                           ("user", "and then what"))
    assert "[reply stopped]" in err and "tokens per target call" in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_reply_cut_at_max_new_tokens_says_so(monkeypatch, capsys, tiny_bundle, api):
    result = api.generate(messages=[{"role": "user", "content": "hello there"}], **SETTINGS)
    assert result.stop_reason == "max_new_tokens"  # the tiny model does not stop in 24
    code, out, err = chat(monkeypatch, capsys, tiny_bundle, "hello there\n")
    assert code == 0 and out == result.text + "\n"
    assert f"[reply cut at --max-new-tokens {NEW_TOKENS}]" in err


def test_chat_help_lists_the_in_chat_commands(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    out = capsys.readouterr().out
    for command in ("/stats", "/reset", "/system TEXT", "/exit", "Ctrl-C"):
        assert command in out


def test_ctrl_c_at_the_prompt_exits_130(monkeypatch, capsys, tiny_bundle):
    class CtrlC(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdin", CtrlC())
    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--bundle", str(tiny_bundle)])
    assert exit_.value.code == 130


def test_chat_through_a_subprocess(tiny_bundle, api):
    proc = subprocess.run([sys.executable, "-m", "specedge.cli", "chat", "--bundle",
                           str(tiny_bundle), "--max-new-tokens", str(NEW_TOKENS)],
                          input="hello there\n/stats\n", capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reply(api, ("user", "hello there")) + "\n"
    assert "tokens per target call" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_arrow_keys_edit_the_line_at_a_terminal(tiny_bundle, api):
    """At a terminal (a pseudo-terminal here) the line is read with readline: "helo", the
    left arrow and "l" send "hello", not the arrow's escape code."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat on the terminal's side
        os.execv(sys.executable, [sys.executable, "-m", "specedge.cli", "chat", "--bundle",
                                  str(tiny_bundle), "--max-new-tokens", str(NEW_TOKENS)])
    output = b""

    def read_until(marker: bytes, timeout: float = 120) -> None:
        nonlocal output
        deadline = time.monotonic() + timeout
        while marker not in output:
            assert time.monotonic() < deadline, output.decode(errors="replace")
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    output += os.read(fd, 65536)
                except OSError:
                    break

    try:
        read_until(b"> ")
        os.write(fd, b"helo\x1b[Dl\r")
        want = reply(api, ("user", "hello"))
        read_until(want.encode())
        os.write(fd, b"\x04")  # Ctrl-D: end of input
        read_until(b"\n", 30)
    finally:
        if os.waitpid(pid, os.WNOHANG) == (0, 0):  # still running
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert want.encode() in output


def test_what_is_typed_while_a_reply_streams_is_not_echoed_into_it(monkeypatch, tmp_path):
    """On a terminal (a pseudo-terminal here), a line typed while the reply streams is not
    echoed between the reply's pieces, and is still read afterwards as the next command;
    the terminal echoes again once the reply ends."""
    import pty
    import termios

    from specedge.chat_cli import Chat
    from specedge.runtime.config import GenerationConfig

    controller, terminal = pty.openpty()
    stdin = os.fdopen(terminal, "r", closefd=False)
    monkeypatch.setattr(sys, "stdin", stdin)

    class Streaming:
        """Yields a reply in pieces; the user types a command after the first one."""

        last_result = None

        def stream(self, **kwargs):
            yield "The sky "
            os.write(controller, b"/stats\n")
            time.sleep(0.2)  # the terminal driver handles the typing meanwhile
            yield "is blue."
            self.last_result = type("R", (), {"text": "The sky is blue.", "stats": {},
                                              "stop_reason": "eos"})()

        def context_limit(self, config):
            return 10**6

        codec = type("C", (), {"encode_chat": staticmethod(lambda messages: [1, 2])})

    out, err = io.StringIO(), io.StringIO()
    chat = Chat(Streaming(), GenerationConfig(max_new_tokens=8), out=out, err=err)
    chat.reply("why?")
    os.set_blocking(controller, False)
    try:
        echoed = os.read(controller, 1024)
    except BlockingIOError:
        echoed = b""
    assert b"/stats" not in echoed
    assert out.getvalue() == "The sky is blue.\n"
    assert stdin.readline() == "/stats\n"  # still there, run after the reply
    assert termios.tcgetattr(terminal)[3] & termios.ECHO
    os.close(controller)
    os.close(terminal)
