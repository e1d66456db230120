"""The `flashinfer-lite` command: one subcommand per module, each with add_arguments(parser) and run(args)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__
from storage.errors import Reported, UserError, os_error_line

# name -> (module, help). Modules are imported only for the command that runs, so `generate` never pays for torch.
COMMANDS = {
    "generate": ("flashinfer_lite.generate", "generate text from one prompt"),
    "chat": ("flashinfer_lite.chat", "chat with a model, keeping the conversation across turns"),
    "serve": ("flashinfer_lite.serve", "serve a model over HTTP with the OpenAI API (chat and text completions)"),
    "convert": ("storage.convert", "convert an HF directory or GGUF file into the flash layout"),
    "order-neurons": ("predictors.coact", "convert a gated model with the neurons that fire together stored "
                                          "together (co-activation order): a token's down rows in fewer runs"),
    "verify": ("storage.verify", "check a flash directory's checksums"),
    "flash-bench": ("storage.flash_bench", "profile flash read bandwidth (chunk size x threads) and tune the reader"),
    "collect": ("predictors.collect", "record FFN inputs and activations of a model over a corpus"),
    "count-experts": ("predictors.expert_freq", "count how often a mixture of experts routes to each expert on "
                                                "calibration text: the most routed are pinned in DRAM"),
    "train-predictor": ("predictors.train", "calibrate thresholds and train low-rank activation predictors"),
    "eval": ("predictors.evaluate", "perplexity, agreement with dense and active share of an FFN mode"),
    "fetch": ("flashinfer_lite.fetch", "download the default model (SmolLM2-135M-Instruct) into the cache"),
    "cache": ("flashinfer_lite.manage", "list or remove what the cache holds (converted models, the default model)"),
}


# The commands that load a model: their libraries are imported one at a time first (the command's module imports them
# anyway), so that -v can tell what each added to the process base (warmup.base_parts)
MODEL_COMMANDS = ("generate", "chat", "serve")


def mark_libraries() -> None:
    from .process import mark_rss
    mark_rss("interpreter")
    import numpy  # noqa: F401
    mark_rss("numpy")
    import llvmlite.binding  # noqa: F401
    mark_rss("llvmlite (the LLVM library)")
    import numba  # noqa: F401
    mark_rss("numba")


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashinfer-lite", description="Run LLMs whose FFN weights stay on flash.")
    parser.add_argument("--version", action="version", version=f"flashinfer-lite {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == command:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in MODEL_COMMANDS:
        mark_libraries()
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args) or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Reported as e:
        return e.code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head` closed the pipe: not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:     # a full disk (ENOSPC), a read-only one (EROFS): every writer removed its temp files
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
