"""Command line of the Crowdtrain agent.

Examples::

    # log this machine in through the browser (once); the token is saved for later runs
    crowdtrain-agent login --server https://crowdtrain.example.org
    crowdtrain-agent login --server https://crowdtrain.example.org --name lab-gpu-3 --no-browser
    crowdtrain-agent whoami
    crowdtrain-agent logout

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
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from . import __version__
from .allocator import keep_freed_memory
from .config import (
    DEFAULT_SERVER,
    DEVICE_CHOICES,
    ENV_PREFIX,
    AgentConfig,
    ConfigError,
    default_config_path,
    forget_token,
    load_config,
    login_server,
    read_config_file,
    write_config_file,
)
from .control import AgentStopped
from .logformat import JsonFormatter, parse_log_format
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
    controls = run.add_argument_group(
        "your controls",
        "When the agent may work and what it may use. Each may also be set as CROWDTRAIN_AGENT_<NAME> or in a "
        "JSON file (--controls FILE, default: controls.json beside the saved login) with the keys idle_minutes, "
        "max_other_cpu_percent, schedule, pause_on_battery, gpus, gpu_memory_gb, upload_kbps, download_kbps. "
        "When one stops work, the lease in hand is given back at once and the panel says why.",
    )
    controls.add_argument("--idle-minutes", metavar="N", help="work only after N minutes without keyboard or mouse")
    controls.add_argument(
        "--max-other-cpu", metavar="PERCENT", help="pause while other programs use more than this share of the CPUs"
    )
    controls.add_argument(
        "--schedule", metavar="TEXT", help="when it may work, e.g. 'mon-fri 18:00-08:00; sat,sun 00:00-24:00'"
    )
    controls.add_argument("--pause-on-battery", action="store_true", default=None, help="pause while on battery")
    controls.add_argument("--gpus", metavar="0,1", help="the CUDA GPUs it may use, by index (it computes on the first)")
    controls.add_argument("--gpu-memory-gb", metavar="GB", help="use at most this much of the GPU's memory")
    controls.add_argument("--upload-kbps", metavar="KBIT/S", help="upload at most this fast (kilobits per second)")
    controls.add_argument("--download-kbps", metavar="KBIT/S", help="download at most this fast (kilobits per second)")
    controls.add_argument("--controls", metavar="FILE", dest="controls_file", help="the controls file to read")
    run.add_argument("-v", "--verbose", action="count", default=0, help="more detail: -v debug lines from the agent")
    run.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="text (default) or json: one JSON object per log line, for a log collector",
    )

    login = commands.add_parser(
        "login",
        help="log this machine in through the browser and save its token",
        description=(
            "Show a short code, open the site's device page in the browser, and wait until you approve the code "
            "there while logged in to your account. The new device token is saved for later runs "
            f"(readable by you only) in {default_config_path()}, or the file CROWDTRAIN_AGENT_CONFIG names."
        ),
    )
    login.add_argument(
        "--server",
        metavar="URL",
        help=f"the site's address (default: CROWDTRAIN_AGENT_SERVER, else the saved login, else {DEFAULT_SERVER})",
    )
    login.add_argument("--name", help="the device name to propose (default: this machine's host name)")
    login.add_argument(
        "--no-browser", dest="browser", action="store_false", help="only print the address; open nothing"
    )
    login.add_argument("-v", "--verbose", action="count", default=0, help="more detail: -v debug lines")
    whoami = commands.add_parser("whoami", help="show the account and device the saved token belongs to")
    whoami.add_argument("-v", "--verbose", action="count", default=0, help="more detail: -v debug lines")
    logout = commands.add_parser("logout", help="revoke this device's token on the site and delete it here")
    logout.add_argument("-v", "--verbose", action="count", default=0, help="more detail: -v debug lines")
    return parser


class _CurrentStderr:
    """Whatever sys.stderr is at write time: rich's live panel swaps it to print lines above itself."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(verbose: int, *, live: bool, log_format: str = "text") -> None:
    """Send log lines to stderr; under the live panel only warnings, unless -v. ``json``: one object a line."""
    level = logging.DEBUG if verbose else (logging.WARNING if live else logging.INFO)
    handler = logging.StreamHandler(_CurrentStderr())
    # Debug lines time the pipeline's phases, so -v shows milliseconds.
    stamp = "%(asctime)s.%(msecs)03d" if verbose else "%(asctime)s"
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(f"{stamp} %(levelname)-7s %(message)s", "%H:%M:%S"))
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
    account_commands = {"login": _login, "whoami": _whoami, "logout": _logout}
    if args.command in account_commands:
        configure_logging(args.verbose, live=False)
        try:
            return account_commands[args.command](args)
        except ConfigError as exc:
            print(f"crowdtrain-agent: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        except KeyboardInterrupt:
            print(f"crowdtrain-agent: {args.command} cancelled", file=sys.stderr)
            return 130
    if args.command != "run":
        parser.print_help()
        return EXIT_CONFIG
    live = bool(args.progress) and sys.stdout.isatty()
    try:
        log_format = args.log_format or parse_log_format(
            os.environ.get(ENV_PREFIX + "LOG_FORMAT", "text"), ENV_PREFIX + "LOG_FORMAT"
        )
    except ValueError as exc:
        print(f"crowdtrain-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(args.verbose, live=live, log_format=log_format)
    try:
        config = load_config(vars(args))
    except ConfigError as exc:
        print(f"crowdtrain-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return _run(config, live=live)


def _login(args: argparse.Namespace) -> int:
    from rich.console import Console

    from . import login

    server = login_server(args.server)
    name = " ".join((args.name or login.default_device_name()).split())[: login.MAX_NAME]
    if not name or not name.isprintable():
        raise ConfigError(f"--name must be printable text of 1 to {login.MAX_NAME} characters, got {args.name!r}")
    path = default_config_path()
    try:
        issued = login.login(server, name=name, open_browser=args.browser, console=Console())
    except login.LoginDenied as exc:
        print(f"crowdtrain-agent: login denied: {exc}. Nothing was saved; run login again to retry.", file=sys.stderr)
        return EXIT_STOPPED
    except login.LoginExpired as exc:
        print(
            f"crowdtrain-agent: login expired: {exc}. Run `crowdtrain-agent login --server {server}` again "
            "and approve the new code within its time.",
            file=sys.stderr,
        )
        return EXIT_STOPPED
    except login.LoginError as exc:
        print(f"crowdtrain-agent: login failed: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    write_config_file(path, server=server, token=issued.token)
    who = issued.identity
    print(
        f"Logged in to {server} as {who.user}; this machine is device {who.device_name!r} (#{who.device_id}).\n"
        f"Saved the token in {path} (readable by you only). Start computing with: crowdtrain-agent run"
    )
    return 0


def _whoami(args: argparse.Namespace) -> int:
    from . import login

    try:
        config = load_config({})
    except ConfigError as exc:
        print(f"crowdtrain-agent: not logged in: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    try:
        who = login.whoami(config.server, config.token)
    except login.TokenRejected as exc:
        print(
            f"crowdtrain-agent: {exc}: the device was revoked, or the token belongs to another site. "
            f"Log in again: crowdtrain-agent login --server {config.server}",
            file=sys.stderr,
        )
        return EXIT_STOPPED
    except login.LoginError as exc:
        print(f"crowdtrain-agent: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    print(f"user:   {who.user}\ndevice: {who.device_name} (#{who.device_id})\nserver: {who.server or config.server}")
    return 0


def _logout(args: argparse.Namespace) -> int:
    from . import login

    path = default_config_path()
    saved = read_config_file(path)
    token, server = saved.get("token"), saved.get("server") or DEFAULT_SERVER
    if not token:
        print(f"Not logged in: no saved token in {path}.")
        return 0
    try:
        told = "revoked this device's token" if login.revoke(server, token) else "no longer knew this token"
    except login.LoginError as exc:
        told = ""
        print(
            f"crowdtrain-agent: {exc}. The site was not told: the token still works there until you revoke "
            f"this device on {server}/devices/",
            file=sys.stderr,
        )
    forget_token(path)
    print(f"Logged out: {'the site ' + told + ', and ' if told else ''}the token was deleted from {path}.")
    return 0


def _run(config: AgentConfig, *, live: bool) -> int:
    from rich.console import Console

    from .runtime import Agent  # imports torch: keep --help and --version fast

    keep_freed_memory()  # a process-wide setting: here, not when the agent is imported as a library
    if config.gpus:  # before PyTorch starts CUDA: the GPUs the volunteer named are the only ones it sees
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in config.gpus)
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


def console_main() -> NoReturn:
    """The ``crowdtrain-agent`` command: ``main``, then the process ends at once with its code.

    Once the agent has stopped (leases given back, logs written) nothing is left to clean up, and
    interpreter shutdown is where CUDA builds of PyTorch abort ("terminate called without an active
    exception", SIGABRT) while one of their thread pools is still alive, and where a library's
    non-daemon thread would keep the process waiting: Ctrl-C must end with the code the agent chose.
    """
    try:
        code = main()
    except SystemExit as exc:  # argparse: --help, --version, usage errors (it printed them already)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


if __name__ == "__main__":
    console_main()
