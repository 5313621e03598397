"""`specedge <command>`: generate, chat, serve, export, build, distill, corpus, bench,
doctor, gpu-check.

Each command imports only what it needs, so `specedge generate`, `specedge chat`,
`specedge serve`, `specedge doctor` and `specedge build` run where torch is absent.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from specedge import chat_cli, generate_cli
from specedge.bench import run as bench_run
from specedge.doctor import cli as doctor_cli
from specedge.export import cli as export_cli
from specedge.gpu_check import check as gpu_check
from specedge.serve import cli as serve_cli


class Parser(argparse.ArgumentParser):
    """Bad usage: one line on stderr and exit status 2, never a usage dump or a traceback."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


@dataclass(frozen=True)
class Command:
    """One `specedge` command: its name, its one-line help, what adds its flags and what
    runs it (an exit status, or None for 0)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]
    parser_options: dict = field(default_factory=dict)


COMMANDS = (
    Command("generate", "generate text from a bundle (no torch needed)",
            generate_cli.add_generate_arguments, generate_cli.run_generate),
    Command("chat", "chat with a bundle in the terminal (no torch needed)",
            chat_cli.add_chat_arguments, chat_cli.run_chat,
            {"epilog": chat_cli.IN_CHAT_HELP,
             "formatter_class": argparse.RawDescriptionHelpFormatter}),
    Command("serve", "an OpenAI-compatible HTTP server for a bundle (needs the serve extra: "
            "pip install 'specedge[serve]')", serve_cli.add_serve_arguments,
            serve_cli.run_serve),
    Command("export", "Hugging Face model -> bundle (needs the export extra: pip install "
            "'specedge[export]')", export_cli.add_export_arguments, export_cli.run),
    Command("distill", "train a small draft for a target on text the target generates (needs "
            "the export extra)", export_cli.add_distill_arguments, export_cli.run_distill),
    Command("corpus", "grow a distillation corpus: the target's answers to varied requests, "
            "as token ids, for `specedge distill --corpus` (needs the export extra)",
            export_cli.add_corpus_arguments, export_cli.run_corpus),
    Command("build", "bundle -> TensorRT engines, on the device that will run them (needs "
            "tensorrt and cuda-python, no torch)", export_cli.add_build_arguments,
            export_cli.run_build),
    Command("bench", "speculative vs plain decoding and other systems on a prompt set; "
            "writes JSON, markdown, plots", bench_run.add_arguments, bench_run.main),
    Command("doctor", "what this device is and what runs on it: CPU, memory, versions, "
            "backends, and with --bundle its load and step times", doctor_cli.add_arguments,
            doctor_cli.run),
    Command("gpu-check", "the GPU path end to end on a CUDA machine, against ort-cpu; writes "
            "a JSON report (docs/gpu.md)", gpu_check.add_arguments, gpu_check.run),
)


def build_parser() -> Parser:
    """`specedge` and its commands with all their flags."""
    parser = Parser(prog="specedge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_arguments(sub.add_parser(command.name, help=command.help,
                                             **command.parser_options))
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)  # a bare `specedge`: what it can do, not one error line
        sys.exit(2)
    args = parser.parse_args(argv)
    status = next(c for c in COMMANDS if c.name == args.command).run(args)
    if status is not None:
        sys.exit(status)


if __name__ == "__main__":
    main()
