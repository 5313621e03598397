"""`specedge <command>`: generate, chat, serve, export, build, distill, corpus, bench,
doctor, gpu-check.

Each command imports only what it needs, so `specedge generate`, `specedge chat`,
`specedge serve`, `specedge doctor` and `specedge build` run where torch is absent.
"""

from __future__ import annotations

import argparse
import sys

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


def build_parser() -> Parser:
    """`specedge` and its commands with all their flags."""
    parser = Parser(prog="specedge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    generate_cli.add_generate(sub)
    chat_cli.add_chat(sub)
    for name, help_text, add_arguments in (
        ("serve", "an OpenAI-compatible HTTP server for a bundle (needs the serve extra: "
         "pip install 'specedge[serve]')", serve_cli.add_serve_arguments),
        ("export", "Hugging Face model -> bundle (needs the export extra: pip install "
         "'specedge[export]')", export_cli.add_export_arguments),
        ("distill", "train a small draft for a target on text the target generates (needs "
         "the export extra)", export_cli.add_distill_arguments),
        ("corpus", "grow a distillation corpus: the target's answers to varied requests, as "
         "token ids, for `specedge distill --corpus` (needs the export extra)",
         export_cli.add_corpus_arguments),
        ("build", "bundle -> TensorRT engines, on the device that will run them (needs "
         "tensorrt and cuda-python, no torch)", export_cli.add_build_arguments),
        ("bench", "speculative vs plain decoding and other systems on a prompt set; writes "
         "JSON, markdown, plots", bench_run.add_arguments),
        ("doctor", "what this device is and what runs on it: CPU, memory, versions, "
         "backends, and with --bundle its load and step times", doctor_cli.add_arguments),
        ("gpu-check", "the GPU path end to end on a CUDA machine, against ort-cpu; writes a "
         "JSON report (docs/gpu.md)", gpu_check.add_arguments),
    ):
        add_arguments(sub.add_parser(name, help=help_text))
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)  # a bare `specedge`: what it can do, not one error line
        sys.exit(2)
    args = parser.parse_args(argv)
    if args.command == "bench":
        bench_run.main(args)
    elif args.command == "build":
        export_cli.run_build(args)
    elif args.command == "export":
        export_cli.run(args)
    elif args.command == "distill":
        export_cli.run_distill(args)
    elif args.command == "corpus":
        export_cli.run_corpus(args)
    elif args.command == "serve":
        serve_cli.run_serve(args)
    elif args.command == "chat":
        chat_cli.run_chat(args)
    elif args.command == "doctor":
        sys.exit(doctor_cli.run(args))
    elif args.command == "gpu-check":
        sys.exit(gpu_check.run(args))
    else:
        generate_cli.run_generate(args)


if __name__ == "__main__":
    main()
