"""`specedge chat`: a conversation with a bundle in the terminal, on the runtime.

Lines read from stdin are user messages; each reply streams to stdout as it is generated and
joins the history, which goes back to the model as `messages` on the next turn. A line that
is one of the commands below is not sent:

    /stats         the last reply's speculative-decoding statistics
    /reset         forget the conversation (the system message stays)
    /system TEXT   set the system message (`/system` alone removes it)
    /exit          quit (so do /quit, end of input and Ctrl-D)
    /help          these commands

stdout carries only the replies (each ends with a newline), so piped input gives a
transcript of the answers; statistics and notices go to stderr (a reply cut at
--max-new-tokens says so there). Ctrl-C during a reply stops it after the step in progress
and keeps the session, and /stats then describes the stopped reply; a second Ctrl-C stops it
at once. Ctrl-C at the prompt quits with exit status 130. At a terminal, lines are read with
readline: arrow keys edit the line and walk through the lines sent before.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from specedge.cli_common import (
    add_bundle_flag,
    add_generation_flags,
    bad_input_exits_2,
    ctrl_c_exits_130,
    fail,
    generation_config,
)
from specedge.generate_cli import summary
from specedge.runtime.config import GenerationConfig
from specedge.runtime.errors import SpecEdgeError

COMMANDS = ("/stats", "/reset", "/system", "/exit", "/help")
# A line starting with a slash and a lower-case word is meant as a command (a typo is
# reported, not sent); other lines starting with "/" (a path, say) are messages.
_COMMAND_LIKE = re.compile(r"/[a-z]+(\s|$)")


IN_CHAT_HELP = """commands typed at the prompt:
  /stats         the last reply's speculative-decoding statistics
  /reset         forget the conversation (the system message stays)
  /system TEXT   set the system message (/system alone removes it)
  /exit          quit (so do /quit, Ctrl-D and the end of piped input)
  /help          these commands
Ctrl-C stops a reply after its current step (twice: at once); at the prompt it quits."""


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """The flags; the in-chat commands go in the help's epilog (IN_CHAT_HELP, specedge/cli.py)."""
    add_bundle_flag(p)
    p.add_argument("--system", default=None, help="system message for the conversation")
    add_generation_flags(p)
    p.add_argument("--stats", action="store_true",
                   help="print the speculative-decoding statistics after every reply")


class Chat:
    """A conversation on one generator with one `GenerationConfig`: the system message, the
    turns so far, and the statistics of the last reply."""

    def __init__(self, gen, config: GenerationConfig, system: str | None = None,
                 out: TextIO | None = None, err: TextIO | None = None):
        self.gen = gen
        self.config = config
        self.system = system
        self.turns: list[dict[str, str]] = []  # user and assistant messages, alternating
        self.last_stats: dict | None = None
        self.why_no_stats = "no reply yet"  # what /stats says while last_stats is None
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.context = gen.context_limit(config)
        self.max_new_tokens = config.max_new_tokens
        if self.max_new_tokens >= self.context:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens} leaves no room for a "
                             f"prompt in the bundle's context of {self.context} tokens; "
                             "lower it")

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def command(self, line: str) -> bool:
        """Run `line` if it is a command; False when it is a message to send. Raises
        EOFError on /exit."""
        if not _COMMAND_LIKE.match(line):
            return False
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/quit"):  # /quit: what other chat programs take
            raise EOFError
        if name == "/help":
            print(IN_CHAT_HELP, file=self.err)
            return True
        if name == "/stats":
            print(summary(self.last_stats) if self.last_stats else
                  f"no statistics: {self.why_no_stats}", file=self.err)
        elif name == "/reset":
            self.turns.clear()
            self.last_stats = None
            self.why_no_stats = "no reply yet"
            print("conversation cleared" + (" (the system message stays)" if self.system
                                            else ""), file=self.err)
        elif name == "/system":
            self.system = rest.strip() or None
            print("system message " + ("set" if self.system else "removed"), file=self.err)
        else:
            print(f"unknown command {name}; the commands are {', '.join(COMMANDS)} "
                  "(/system takes the message as TEXT)", file=self.err)
        return True

    def reply(self, text: str, show_stats: bool = False) -> None:
        """Send one user message and stream the reply to `out`. Ctrl-C stops the reply; what
        was shown of it stays in the history."""
        self.turns.append({"role": "user", "content": text})
        self.last_stats = None
        if not self._fit():
            self.turns.pop()
            self.why_no_stats = "the last message did not fit the context"
            return
        pieces: list[str] = []
        cancel = threading.Event()
        stream = self.gen.stream(messages=self.messages(), config=self.config, cancel=cancel)
        try:
            with _ctrl_c_sets(cancel), _typing_not_echoed():
                for piece in stream:
                    pieces.append(piece)
                    print(piece, end="", file=self.out, flush=True)
        except KeyboardInterrupt:
            stream.close()
            print(file=self.out, flush=True)
            print("[reply stopped]", file=self.err)
            self.turns.append({"role": "assistant", "content": "".join(pieces)})
            self.why_no_stats = "the last reply was stopped at once, inside a model call"
            return
        except (ValueError, SpecEdgeError) as e:
            stream.close()
            if pieces:
                print(file=self.out, flush=True)
            print(f"specedge: error: {e}", file=self.err)
            self.turns.pop()
            self.why_no_stats = "the last message failed"
            return
        print(file=self.out, flush=True)
        result = self.gen.last_result
        self.turns.append({"role": "assistant", "content": result.text})
        self.last_stats = result.stats
        if result.stop_reason == "cancelled":
            print("[reply stopped]", file=self.err)
        elif result.stop_reason == "max_new_tokens":
            print(f"[reply cut at --max-new-tokens {self.max_new_tokens}]", file=self.err)
        if show_stats:
            print(summary(result.stats), file=self.err)

    def _fit(self) -> bool:
        """Drop the oldest turns (user message and reply) until the prompt plus
        max_new_tokens fits the context; False if the newest message alone does not."""
        dropped = 0
        while True:
            prompt = len(self.gen.codec.encode_chat(self.messages()))
            if prompt + self.max_new_tokens <= self.context:
                break
            if len(self.turns) <= 1:
                print(f"specedge: error: this message ({prompt} tokens with the chat "
                      f"template) + --max-new-tokens {self.max_new_tokens} exceeds the "
                      f"bundle's context of {self.context} tokens; send a shorter message or "
                      "lower --max-new-tokens", file=self.err)
                break
            del self.turns[:2]
            dropped += 1
        if dropped:
            print(f"[history over the context of {self.context} tokens: dropped the oldest "
                  f"{dropped} turn{'s' if dropped > 1 else ''}]", file=self.err)
        return prompt + self.max_new_tokens <= self.context


def run_chat(args: argparse.Namespace) -> None:
    from specedge.runtime.generator import Generator

    interactive = sys.stdin.isatty()
    with bad_input_exits_2(), ctrl_c_exits_130():
        config = generation_config(args)  # bad settings fail before the bundle loads
        gen = Generator.from_bundle(args.bundle, backend=args.backend, threads=args.threads,
                                    spinning=args.thread_spinning)
        if not gen.codec.has_chat_template:
            fail(f"the bundle {args.bundle} has no chat template, so it cannot hold a "
                 "conversation; use `specedge generate --raw` for plain text completion")
        chat = Chat(gen, config, system=args.system)  # and those the context limits
    if interactive:
        try:
            import readline  # noqa: F401  (input() then edits lines and keeps a history)
        except ImportError:  # Python built without it (Windows): plain input()
            pass
        print(f"chatting with {args.bundle}; commands: {', '.join(COMMANDS)}; "
              "Ctrl-C stops a reply, Ctrl-D quits", file=sys.stderr)
    with ctrl_c_exits_130():
        while True:
            try:
                line = _read(interactive)
                if line.strip() and not chat.command(line.strip()):
                    chat.reply(line.rstrip("\r\n"), show_stats=args.stats)
            except EOFError:
                return


@contextmanager
def _ctrl_c_sets(cancel: threading.Event) -> Iterator[None]:
    """While the block runs on the main thread, the first Ctrl-C sets `cancel` (the
    generation ends after its step, with its statistics) and a second raises
    KeyboardInterrupt as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_ctrl_c(signum, frame) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def _typing_not_echoed() -> Iterator[None]:
    """While a reply streams to a terminal, what the user types is not echoed into it (the
    terminal's ECHO off): the line stays in the input, read and run once the reply ends, as
    a line typed at the prompt is. Elsewhere (a pipe, no termios) nothing changes."""
    try:
        import termios

        fd = sys.stdin.fileno()
        before = termios.tcgetattr(fd) if sys.stdin.isatty() else None
    except (ImportError, OSError, ValueError, AttributeError):
        before = None
    if before is None:
        yield
        return
    quiet = list(before)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, before)


def _read(interactive: bool) -> str:
    """The next line of input; EOFError at the end."""
    if interactive:
        try:
            return input("> ")  # line editing where readline is available
        except EOFError:
            print(file=sys.stderr)  # end the prompt's line
            raise
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line
