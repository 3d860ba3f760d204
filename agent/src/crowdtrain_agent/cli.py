"""Command line of the Crowdtrain agent.

Examples::

    # join whatever campaign the site schedules, on the best local device
    crowdtrain-agent run --server https://crowdtrain.example.org --token ct_dev_4f9a...

    # a local development site, one campaign, CPU only, 4 threads, plain log lines
    crowdtrain-agent run --server http://127.0.0.1:8000 --campaign 3 --device cpu --threads 4 --no-progress

    # the same through the environment (flags win over variables)
    CROWDTRAIN_AGENT_TOKEN=ct_dev_4f9a... CROWDTRAIN_AGENT_DEVICE=cuda crowdtrain-agent run

    # benchmarks and tests: stop after 20 leases
    crowdtrain-agent run --server http://127.0.0.1:8000 --max-leases 20 --no-progress -v

    crowdtrain-agent --version
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from collections.abc import Sequence

from . import __version__
from .config import DEFAULT_SERVER, DEVICE_CHOICES, AgentConfig, ConfigError, default_config_path, load_config
from .control import AgentStopped
from .progress import AgentStatus, LiveProgress

logger = logging.getLogger(__name__)

EXIT_STOPPED = 1  # the site refused the agent, or could not be reached
EXIT_CONFIG = 2  # same as argparse's usage errors


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; also the source of `--help`."""
    parser = argparse.ArgumentParser(
        prog="crowdtrain-agent",
        description="Lend this machine's GPU (or CPU) to a Crowdtrain training campaign.",
    )
    parser.add_argument("--version", action="version", version=f"crowdtrain-agent {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="connect to the site and compute gradients until stopped",
        description=(
            "Connect to a Crowdtrain site, take leases of training samples, compute their gradients on this "
            "machine and stream them to the campaign's aggregators. Ctrl-C once finishes and reports the lease "
            "in progress, then exits; Ctrl-C twice gives unfinished work back and exits at once."
        ),
        epilog=(
            "Every option can also come from the environment: CROWDTRAIN_AGENT_SERVER, CROWDTRAIN_AGENT_TOKEN, "
            "CROWDTRAIN_AGENT_DEVICE, CROWDTRAIN_AGENT_THREADS, CROWDTRAIN_AGENT_CAMPAIGN, "
            f"CROWDTRAIN_AGENT_CACHE_DIR. Flags win over variables, variables over the saved login in "
            f"{default_config_path()}."
        ),
    )
    run.add_argument(
        "--server", metavar="URL", help=f"the site's address (default: the saved login, else {DEFAULT_SERVER})"
    )
    run.add_argument("--token", metavar="TOKEN", help="this device's API token (default: the saved login)")
    run.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        type=str.lower,
        help="where to compute; auto picks CUDA, then Apple MPS, then the CPU (default: auto)",
    )
    run.add_argument("--threads", metavar="N", help="CPU threads for PyTorch (torch.set_num_threads)")
    run.add_argument("--campaign", metavar="ID", dest="campaign_id", help="work only for this campaign id")
    run.add_argument(
        "--cache-dir", metavar="DIR", help="where verified data shards are kept (default: the user cache folder)"
    )
    run.add_argument("--max-leases", metavar="N", help="stop after N leases (benchmarks, tests)")
    run.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="log plain lines instead of the live panel (automatic when stdout is not a terminal)",
    )
    run.add_argument("-v", "--verbose", action="count", default=0, help="more detail: -v debug lines from the agent")
    return parser


class _CurrentStderr:
    """Whatever sys.stderr is at write time: rich's live panel swaps it to print lines above itself."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(verbose: int, *, live: bool) -> None:
    """Send log lines to stderr; under the live panel only warnings, unless -v."""
    level = logging.DEBUG if verbose else (logging.WARNING if live else logging.INFO)
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))
    handler.set_name("crowdtrain-agent")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "crowdtrain-agent"]:
        root.removeHandler(old)  # main() may run more than once in one process (tests)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    # Our own messages at the chosen level; third-party chatter (websockets) stays at WARNING.
    logging.getLogger("crowdtrain_agent").setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``crowdtrain-agent`` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "run":
        parser.print_help()
        return EXIT_CONFIG
    live = bool(args.progress) and sys.stdout.isatty()
    configure_logging(args.verbose, live=live)
    try:
        config = load_config(vars(args))
    except ConfigError as exc:
        print(f"crowdtrain-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return _run(config, live=live)


def _run(config: AgentConfig, *, live: bool) -> int:
    from rich.console import Console

    from .runtime import Agent  # imports torch: keep --help and --version fast

    status = AgentStatus()
    # Signal handlers can only be installed from the main thread; elsewhere (tests) stop programmatically.
    agent = Agent(config, status=status, handle_signals=threading.current_thread() is threading.main_thread())
    try:
        if live:
            with LiveProgress(status, Console()):
                return asyncio.run(agent.run())
        return asyncio.run(agent.run())
    except AgentStopped as exc:
        print(f"crowdtrain-agent: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except ConfigError as exc:
        print(f"crowdtrain-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
