"""glibc malloc settings for the processes that allocate the same large tensors over and over: agents and aggregators.

It lives in the agent package because that is the one package both programs import
(the aggregator depends on crowdtrain-agent; the agent never imports the platform's).
Each program's entry point calls it (``crowdtrain_agent.cli``, ``crowdtrain_backbone.__main__``),
never an import: it changes the whole process.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit machines (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 512 << 20


def keep_freed_memory() -> bool:
    """Make glibc keep freed buffers of up to 32 MiB for reuse instead of unmapping them.

    Every lease allocates megabytes (gradients, the parameters it downloads,
    shard bytes, upload frames) and frees them again, as does every step of an
    aggregator (the mean gradient, the optimizer's temporaries, the published params). With glibc's defaults
    most of these are fresh mmaps, and each first touch of a page is a page
    fault that zeroes it, a visible share of the compute core's time
    (docs/performance.md, "Freed buffers kept"). Reused heap memory costs none
    of that.

    Returns:
        Whether the settings took (False off glibc, e.g. macOS, Windows or musl).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    took = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    logger.debug("malloc keeps freed buffers up to %d bytes: %s", MMAP_THRESHOLD_BYTES, took)
    return took
