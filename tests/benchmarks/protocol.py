"""What decoding and validating the commonest messages costs, against the floor of parsing their JSON.

The site decodes one ``lease_request`` and one ``done`` per lease, and agents
a ``lease``: their cost is part of every lease's. Each figure is the best of
several timed runs, in microseconds, next to ``json.loads`` of the same text
(which checks nothing), so the ratio says what typing and bounds add.

    python -m tests.benchmarks.protocol
"""

from __future__ import annotations

import json
import sys
import timeit
from collections.abc import Callable

from crowdtrain_agent.protocol import (
    DataSpec,
    Lease,
    LeaseDone,
    LeaseRequest,
    ModelSpec,
    Receipt,
    SampleRange,
    SliceRoute,
    decode_message,
    encode_message,
)
from crowdtrain_agent.protocol.messages import AGENT_TO_SITE, SITE_TO_AGENT

from .figures import figure_line

SHARD = "ab" * 32
MESSAGES = {
    "lease_request": (
        LeaseRequest(campaign_id=3, samples_per_s=1234.5, request_id="r-000042", wait_s=10.0),
        AGENT_TO_SITE,
    ),
    "done": (
        LeaseDone(
            lease_id=123456,
            receipts=[Receipt(slice_index=i, token="x" * 43) for i in range(2)],
            num_samples=16,
            loss_sum=12.34,
            compute_s=0.5,
        ),
        AGENT_TO_SITE,
    ),
    "lease": (
        Lease(
            lease_id=123456,
            campaign_id=3,
            base_version=42,
            ranges=[SampleRange(shard=SHARD, start=100, count=16)],
            num_samples=16,
            microbatch_size=16,
            deadline_s=30.0,
            ticket="t" * 200,
            codec="fp32",
            model=ModelSpec(architecture="gpt", config={"vocab_size": 256, "block_size": 128, "n_layer": 4}),
            data=DataSpec(kind="text", sample_len=129),
            param_count=834_000,
            slices=[
                SliceRoute(
                    index=i,
                    start=i * 417_000,
                    end=(i + 1) * 417_000,
                    upload_url="ws://a:9001/upload",
                    params_url="http://a:9001/params/",
                )
                for i in range(2)
            ],
            prefetch=[SHARD],
        ),
        SITE_TO_AGENT,
    ),
}


def best_us(fn: Callable[[], object], number: int = 20_000, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> int:
    for name, (message, allowed) in MESSAGES.items():
        text = encode_message(message)
        decode = best_us(lambda: decode_message(text, allowed))  # noqa: B023 (timed at once)
        floor = best_us(lambda: json.loads(text))  # noqa: B023
        encode = best_us(lambda: encode_message(message))  # noqa: B023
        print(figure_line(f"decode_{name}_us", decode), flush=True)
        print(figure_line(f"decode_{name}_vs_json_loads", decode / floor, f"json.loads {floor:.2f} us"), flush=True)
        print(figure_line(f"encode_{name}_us", encode), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
