"""What decoding and validating the commonest messages costs, against the floor of parsing their JSON.

The site decodes one ``lease_request`` and one ``done`` per lease, and agents
a ``lease``: their cost is part of every lease's. Each figure is the best of
several timed runs, in microseconds, next to ``json.loads`` of the same text
(which checks nothing), so the ratio says what typing and bounds add.

Then each gradient codec on a 4M-element slice (16 MB of fp32) on one CPU
thread: encode and decode throughput in MB of fp32 per second, and the bytes
on the wire per element (``Codec.encoded_size``).

Then parameter downloads as deltas (``crowdtrain_agent.deltas``) between
consecutive versions of a real run: W1's MLP trained a few steps with AdamW
at lr 1e-3, each step's parameters sent as a delta from the previous step's.
Bytes per element against fp32's 4, and encode (aggregator) and decode
(agent) throughput in MB of fp32 per second on one thread; zlib level 1 on
the same shuffled XOR is the floor the compressor was chosen against.

    python -m tests.benchmarks.protocol
"""

from __future__ import annotations

import json
import sys
import timeit
import zlib
from collections.abc import Callable

import torch
from torch.nn import functional as F

from crowdtrain_agent.codec import CODECS, encode_fp32
from crowdtrain_agent.deltas import decode_delta_into, encode_delta, shuffled_xor
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

from .baseline import W1, build_model, make_data
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


CODEC_ELEMENTS = 1 << 22


def codec_lines() -> list[str]:
    """Throughput of every codec's encoder and decoder (the aggregator's ``adopt``) on one thread."""
    torch.set_num_threads(1)  # an aggregator decodes on one core per upload
    grad = torch.randn(CODEC_ELEMENTS, generator=torch.Generator().manual_seed(0))
    megabytes = 4 * CODEC_ELEMENTS / 1e6
    lines = []
    for name, codec in CODECS.items():
        payload = codec.encode(grad)
        encode_s = min(timeit.repeat(lambda: codec.encode(grad), number=1, repeat=5))  # noqa: B023
        decode_s = min(timeit.repeat(lambda: codec.adopt(bytearray(payload), CODEC_ELEMENTS), number=1, repeat=5))  # noqa: B023
        ratio = codec.encoded_size(CODEC_ELEMENTS) / CODEC_ELEMENTS
        lines += [
            figure_line(f"codec_{name}_encode_mb_s", megabytes / encode_s, "MB of fp32 per second, one thread"),
            figure_line(f"codec_{name}_decode_mb_s", megabytes / decode_s, "including a bytearray copy"),
            figure_line(
                f"codec_{name}_bytes_per_element", ratio, f"block {codec.block_size}" if codec.block_size else ""
            ),
        ]
    return lines


DELTA_STEPS = 6  # consecutive versions after the first step (AdamW's first step moves every weight by lr)


def training_versions(steps: int = DELTA_STEPS + 1) -> list[bytes]:
    """The fp32 bytes of W1's parameters before each of ``steps`` AdamW steps (lr 1e-3) and after the last."""
    torch.manual_seed(0)
    x_all, y_all = (torch.from_numpy(a) for a in make_data(W1, 4 * W1.global_batch))
    model = build_model(W1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    versions = [encode_fp32(torch.nn.utils.parameters_to_vector(model.parameters()))]
    for step in range(steps):
        offset = (step * W1.global_batch) % len(x_all)
        for lo in range(offset, offset + W1.global_batch, W1.microbatch):
            x, y = x_all[lo : lo + W1.microbatch], y_all[lo : lo + W1.microbatch]
            (F.cross_entropy(model(x), y, reduction="sum") / W1.global_batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        versions.append(encode_fp32(torch.nn.utils.parameters_to_vector(model.parameters())))
    return versions


def delta_lines() -> list[str]:
    """Size and speed of deltas between consecutive versions (the first step's left out: it moves everything)."""
    torch.set_num_threads(1)
    versions = training_versions()
    pairs = list(zip(versions[2:], versions[1:-1], strict=True))
    elements = sum(len(wanted) for wanted, _ in pairs) // 4
    megabytes = 4 * elements / 1e6
    bodies = [encode_delta(wanted, held) for wanted, held in pairs]
    out = bytearray(len(pairs[0][0]))
    encode_s = min(timeit.repeat(lambda: [encode_delta(w, h) for w, h in pairs], number=1, repeat=3))
    decode_s = min(
        timeit.repeat(
            lambda: [decode_delta_into(b, h, memoryview(out)) for b, (_, h) in zip(bodies, pairs, strict=True)],
            number=1,
            repeat=3,
        )
    )
    planes = [shuffled_xor(w, h).tobytes() for w, h in pairs]
    zlib_sizes = [len(zlib.compress(p, 1)) for p in planes]
    zlib_s = min(timeit.repeat(lambda: [zlib.compress(p, 1) for p in planes], number=1, repeat=3))
    note = f"W1 MLP, AdamW lr 1e-3, {len(pairs)} consecutive versions of {elements // len(pairs)} elements"
    return [
        figure_line("download_delta_bytes_per_element", sum(map(len, bodies)) / elements, f"fp32: 4; {note}"),
        figure_line("download_delta_encode_mb_s", megabytes / encode_s, "MB of fp32 per second, one thread"),
        figure_line("download_delta_decode_mb_s", megabytes / decode_s, "into the caller's buffer"),
        figure_line(
            "download_delta_zlib1_bytes_per_element", sum(zlib_sizes) / elements, "the same planes, zlib level 1"
        ),
        figure_line("download_delta_zlib1_compress_mb_s", megabytes / zlib_s, "compression alone, one thread"),
    ]


def main() -> int:
    for line in codec_lines():
        print(line, flush=True)
    for line in delta_lines():
        print(line, flush=True)
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
