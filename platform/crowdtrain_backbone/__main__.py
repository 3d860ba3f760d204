"""Command line of the backbone aggregator.

Run it next to a site (port 0 picks a free port; the real one is printed)::

    python -m crowdtrain_backbone --site http://127.0.0.1:8000 --token TOKEN --name agg-1 \\
        --host 127.0.0.1 --port 0 --checkpoint-dir var/checkpoints

    CROWDTRAIN_BACKBONE_TOKEN=... CROWDTRAIN_BACKBONE_PUBLIC_HOST=agg1.example.org \\
        python -m crowdtrain_backbone --host 0.0.0.0 --port 8100

On start it prints exactly one line, ``crowdtrain-backbone: listening on http://HOST:PORT``,
for launchers and tests to parse. When the site refuses it for good (an unknown token, another
process on the same token) it exits with status 1 and a line on stderr that says what to do;
anything else (site down, busy, restarting) is retried with backoff. A checkpoint location it
cannot write stops it at once with status 2. SIGTERM and Ctrl-C finish the step in hand, write a
checkpoint of every slice's current version, report it to the site and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from .config import ENV_PREFIX, WS_LOGGER_NAME, BackboneConfig, ConfigError, load_config

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m crowdtrain_backbone",
        description=f"Crowdtrain backbone aggregator. Every flag may also be set as {ENV_PREFIX}<NAME>.",
    )
    parser.add_argument("--site", help="the site's base URL (default http://127.0.0.1:8000)")
    parser.add_argument("--token", help="backbone token issued by the site's admin")
    parser.add_argument("--name", help="stable name, so the site gives this aggregator back its slices")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", help="port to bind; 0 picks a free one (default 8100)")
    parser.add_argument("--checkpoint-dir", dest="checkpoint_dir", help="checkpoint folder (default var/checkpoints)")
    parser.add_argument(
        "--checkpoint-url",
        dest="checkpoint_url",
        help="s3://BUCKET/PREFIX: checkpoints in S3-compatible storage (CROWDTRAIN_S3_* credentials) instead",
    )
    parser.add_argument(
        "--checkpoint-fallback-dir",
        dest="checkpoint_fallback_dir",
        help="folder for checkpoints the store refuses, until it takes them again "
        "(default var/checkpoints-fallback with --checkpoint-url; '' for none)",
    )
    parser.add_argument("--public-host", dest="public_host", help="host agents use to reach this aggregator")
    parser.add_argument("--max-pending-bytes", dest="max_pending_bytes", help="cap on pending gradient bytes")
    parser.add_argument(
        "--spool-dir", dest="spool_dir", help="folder for large pending gradients, on a disk (default var/spool)"
    )
    parser.add_argument(
        "--spool-min-bytes",
        dest="spool_min_bytes",
        help="uploads from this size go to the spool folder, smaller ones stay in memory (default 4194304)",
    )
    parser.add_argument("--torch-threads", dest="torch_threads", help="PyTorch intra-op threads (default 1)")
    parser.add_argument(
        "--header-timeout-s",
        dest="header_timeout_s",
        help="seconds an upload socket has to send its first upload header before it is closed (default 5)",
    )
    parser.add_argument(
        "--metrics-token",
        dest="metrics_token",
        help="bearer token /metrics wants (default: none; then only loopback and private addresses may scrape)",
    )
    parser.add_argument("--log-level", default=os.getenv(ENV_PREFIX + "LOG_LEVEL", "INFO"), help="default INFO")
    parser.add_argument(
        "--log-format",
        default=os.getenv(ENV_PREFIX + "LOG_FORMAT", "text"),
        help="text (default) or json: one JSON object per line, with campaign, lease and step ids",
    )
    return parser


async def _main(config: BackboneConfig) -> int:
    import torch  # loads here, after the config is known to be good

    from crowdtrain_agent.allocator import keep_freed_memory

    from .server import run

    torch.set_num_threads(config.torch_threads)
    keep_freed_memory()  # every step allocates the same megabytes again: reuse them, no page faults

    # SIGTERM (docker stop, kubectl, systemd) and Ctrl-C stop gracefully: the step in hand is
    # finished and every slice checkpointed at its current version, so a restart loses no step.
    # A second signal stops at once.
    stop = asyncio.Event()
    main_task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def on_signal(name: str) -> None:
        if stop.is_set():
            logger.warning("%s again: stopping now, without the last checkpoints", name)
            if main_task is not None:
                main_task.cancel()
            return
        logger.warning("%s: finishing the step in hand and checkpointing before exit (again to stop now)", name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    return await run(
        config, stop=stop, on_listening=lambda url: print(f"crowdtrain-backbone: listening on {url}", flush=True)
    )


def main(argv: list[str] | None = None) -> int:
    """Parse flags, configure logging, run until stopped; returns the exit code."""
    from crowdtrain_agent.logformat import JsonFormatter, parse_log_format

    args = _parser().parse_args(argv)
    try:
        log_format = parse_log_format(args.log_format, "--log-format")
    except ValueError as exc:
        print(f"crowdtrain-backbone: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    logging.getLogger(WS_LOGGER_NAME).setLevel(logging.WARNING)
    try:
        config = load_config({k: v for k, v in vars(args).items() if k not in ("log_level", "log_format")}, os.environ)
    except ConfigError as exc:
        print(f"crowdtrain-backbone: {exc}", file=sys.stderr)
        return 2
    from .checkpoints import LocalStore, StorageUnusable
    from .site_link import SiteRefused  # imports torch: after the config is known to be good

    try:
        # Before anything else: an aggregator that cannot save checkpoints must not take slices.
        store = config.checkpoint_store(os.environ)
        store.check_writable()
        if isinstance(store, LocalStore):
            for leftover in store.remove_stale_temporaries():
                logger.warning("removed %s, left by a checkpoint write that was cut off", leftover)
    except StorageUnusable as exc:
        print(f"crowdtrain-backbone: {exc}", file=sys.stderr)
        return 2

    try:
        return asyncio.run(_main(config))
    except SiteRefused as exc:
        print(f"crowdtrain-backbone: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0
    except OSError as exc:
        print(f"crowdtrain-backbone: cannot listen: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
