"""What the `specedge` commands share on the command line: the flags that several commands
declare alike, the `GenerationConfig` that the generation flags make, and how an error
becomes an exit status (bad usage or input: one line on stderr and status 2; Ctrl-C:
status 130).

Each `add_*` function declares one flag with its name, type, default and choices; a command
that describes a flag in words of its own passes its `help`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from specedge.runtime.backends import BACKENDS
from specedge.runtime.config import (
    DEFAULT_DRAFTER,
    DEFAULT_SPINNING,
    DRAFTERS,
    GenerationConfig,
)
from specedge.runtime.errors import SpecEdgeError

BUNDLE_HELP = "bundle folder made by `specedge export`"
THREADS_HELP = "CPU threads (default: all)"


def add_bundle_flag(parser: argparse.ArgumentParser, help: str | None = BUNDLE_HELP,
                    value_type: Callable[[str], object] | None = None) -> None:
    """--bundle DIR (required); `value_type` converts it (a Path), else it stays a string."""
    parser.add_argument("--bundle", required=True, type=value_type, help=help)


def add_backend_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """--backend, one of the runtime's backends (default ort-cpu)."""
    parser.add_argument("--backend", choices=BACKENDS, default="ort-cpu",
                        help=help or "the runtime backend (default ort-cpu)")


def add_threads_flag(parser: argparse.ArgumentParser, help: str | None = THREADS_HELP) -> None:
    """--threads N, the CPU threads of the runtime (default: all cores)."""
    parser.add_argument("--threads", type=int, default=None, help=help)


def add_draft_threshold_flag(parser: argparse.ArgumentParser, help: str | None = None
                             ) -> None:
    """--draft-threshold t: stop drafting at a token whose draft probability is below t."""
    parser.add_argument("--draft-threshold", type=float, default=0.0,
                        help=help or "stop drafting when the draft's probability for its "
                        "token is below this (0 = off)")


def add_spinning_flag(parser: argparse.ArgumentParser) -> None:
    """--thread-spinning auto|on|off: whether the runtime's CPU threads spin while they wait
    for work (ONNX Runtime's `session.intra_op.allow_spinning`); True, False or "auto" in
    the namespace."""
    parser.add_argument("--thread-spinning", type=spinning_arg, metavar="{auto,on,off}",
                        default=DEFAULT_SPINNING,
                        help="CPU threads spin while they wait for work (ONNX Runtime's "
                        "allow_spinning), each pinned to a core of its own while they do: "
                        "on is fastest on idle cores, off yields the cores to other "
                        "processes; auto (default) spins while other processes leave the "
                        "cores idle, measured as it runs")


def add_max_new_tokens_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default 64")


def add_draft_tokens_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """--draft-tokens K|auto (default None: the runtime's choice, config.py)."""
    parser.add_argument("--draft-tokens", type=draft_tokens_arg, default=None, help=help)


def add_drafter_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    parser.add_argument("--drafter", choices=DRAFTERS, default=DEFAULT_DRAFTER,
                        help=help or f"where draft tokens come from (default {DEFAULT_DRAFTER})")


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `generate` and `chat` share: generation settings, drafting, backend and
    CPU threads and their spinning (`generation_config` turns the generation settings into a
    `GenerationConfig`)."""
    add_max_new_tokens_flag(parser)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    add_draft_tokens_flag(parser, "K, tokens drafted per step, or 'auto' (default: auto when "
                          "greedy, 1 when sampling, so that --seed fixes the text)")
    add_draft_threshold_flag(parser)
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="end the text where TEXT appears (repeat for several)")
    parser.add_argument("--no-draft", action="store_true", help="plain target-only decoding")
    add_drafter_flag(parser, "lookup+model (default): prompt lookup where the context repeats, "
                     "the draft model elsewhere")
    add_backend_flag(parser, "ort-cpu (default); ort-cuda and tensorrt need a GPU (tensorrt: "
                     "engines from `specedge build`); host-emulated runs the GPU backends' "
                     "code on the CPU, for testing")
    add_threads_flag(parser)
    add_spinning_flag(parser)


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The `GenerationConfig` of the flags of `add_generation_flags`; ValueError names a bad
    value and its allowed range, by its flag (GenerationConfig names its field)."""
    try:
        return GenerationConfig(max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed,
                                draft_tokens=args.draft_tokens, use_draft=not args.no_draft,
                                draft_threshold=args.draft_threshold, drafter=args.drafter,
                                stop=args.stop)
    except ValueError as e:
        field, _, rest = str(e).partition(" ")
        if field.isidentifier() and hasattr(args, field):
            raise ValueError(f"--{field.replace('_', '-')} {rest}") from None
        raise


def draft_tokens_arg(value: str) -> int | str:
    """argparse type of --draft-tokens: an integer K or "auto"."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") \
            from None


def spinning_arg(value: str) -> bool | str:
    """argparse type of --thread-spinning: "auto", or on/off as True/False."""
    if value == "auto":
        return value
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected 'auto', 'on' or 'off', got {value!r}")
    return value == "on"


def on_off_arg(value: str) -> bool:
    """argparse type of an on/off flag: True for "on", False for "off"."""
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected 'on' or 'off', got {value!r}")
    return value == "on"


def fail(message: str) -> NoReturn:
    """A usage or input error: one line on stderr, exit status 2."""
    print(f"specedge: error: {message}", file=sys.stderr)
    sys.exit(2)


@contextmanager
def bad_input_exits_2() -> Iterator[None]:
    """A ValueError or SpecEdgeError (a bad value, a bad bundle: the messages say what to
    do) ends the command through `fail`, never as a traceback."""
    try:
        yield
    except (ValueError, SpecEdgeError) as e:
        fail(str(e))


@contextmanager
def ctrl_c_exits_130() -> Iterator[None]:
    """Ctrl-C ends the command with status 130, after a newline on stderr that ends the
    line it interrupted."""
    try:
        yield
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
