"""``python -m server``: the same server and flags as ``dflash2 serve``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from dflash2.engine_args import LOG_LEVEL_HELP, add_engine_args, default_log_level, engine_config_from_args
from server.settings import add_server_args, settings_from_args


def build_parser() -> argparse.ArgumentParser:
    """Server flags, then the engine flags shared with the ``dflash2`` command."""
    parser = argparse.ArgumentParser(prog="python -m server", description="OpenAI-compatible dflash2 server")
    parser.add_argument("--log-level", default=default_log_level(), help=LOG_LEVEL_HELP)
    add_server_args(parser)
    add_engine_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and serve until SIGTERM."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args, engine_config_from_args(args))
    except ValueError as exc:
        print(f"dflash2: error: {exc}", file=sys.stderr)
        return 2
    from server.app import serve

    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
