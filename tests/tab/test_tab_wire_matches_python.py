"""The browser tab's wire modules (frontend/src/tab/*.js) write and read exactly what the agent's Python does."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from crowdtrain_agent.codec import encode_fp16, encode_fp32, encode_int8, get_codec, int8_size
from crowdtrain_agent.data import ShardReader
from crowdtrain_agent.deltas import (
    CHECKSUM_HEADER,
    DELTA_FROM_HEADER,
    ENCODING,
    ENCODING_HEADER,
    DeltaError,
    decode_delta,
    encode_delta,
)
from crowdtrain_agent.feedback import ErrorFeedback, SliceKey
from crowdtrain_agent.protocol import (
    AGENT_TO_SITE,
    AgentHello,
    DataSpec,
    DeviceControls,
    DeviceInfo,
    DoneAck,
    ErrorMessage,
    Heartbeat,
    Lease,
    LeaseDone,
    LeaseRelease,
    LeaseRequest,
    ModelSpec,
    NoLease,
    OptimizerSpec,
    ProtocolError,
    Receipt,
    SampleRange,
    SliceRoute,
    UploadBegin,
    UploadReceipt,
    UploadRejected,
    Welcome,
    decode_message,
    encode_message,
    split_payload,
)
from crowdtrain_agent.trainer import gather_samples
from tests.shards import make_tensor_shards, make_text_shards

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "tab" / "run_vectors.mjs"


def run_vectors(tmp_path: Path, cases: list[dict[str, Any]], files: dict[str, bytes]) -> dict[str, Any]:
    """Write the cases and their input files, run the Node driver on them, and return its results by case name."""
    node = shutil.which("node")
    if node is None:
        pytest.fail(
            "node is not on PATH: the browser tab's wire modules are tested under Node 20. Install it "
            "(apt-get install nodejs npm); `make test` needs it anyway to build the chart bundle"
        )
    if not (REPO / "frontend" / "node_modules" / "fzstd").is_dir():
        pytest.fail("frontend/node_modules/fzstd is missing: run `make charts` (npm ci in frontend/) first")
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([node, str(DRIVER), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the Node driver failed:\n{done.stderr}"
    results: dict[str, Any] = json.loads((tmp_path / "results.json").read_text())
    return results


def output(tmp_path: Path, name: str) -> bytes:
    return (tmp_path / name).read_bytes()


def ok(result: dict[str, Any]) -> Any:
    assert result["ok"], f"{result['error']}: {result['message']}"
    return result["value"]


def refused(result: dict[str, Any], error: str, words: str) -> None:
    assert not result["ok"], f"expected {error} ({words}), got {result.get('value')!r}"
    assert result["error"] == error, result
    assert words in result["message"], result["message"]


def f32(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


# ------------------------------------------------------------------ codecs


def codec_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "normal": f32(rng.standard_normal(1000) * 1e-3),
        "wide": f32(rng.standard_normal(777) * np.exp(rng.uniform(-30, 30, 777))),
        "ties": f32([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.5, 126.5, -126.5, 0.0, -0.0] + [1.0] * 30),
        "zeros": np.zeros(70, dtype=np.float32),
        "subnormal": f32([1e-40, -3e-41, 1.4e-45, 2e-39] * 10),
        "largest": f32([3.4028235e38, -3.4028235e38, 1.0, 2.0e38] * 10),
        "empty": np.zeros(0, dtype=np.float32),
    }


def fp16_inputs() -> np.ndarray:
    ulp = 2.0**-10
    edge = [
        1 + ulp / 2,  # a tie: to the even 1.0
        1 + 3 * ulp / 2,  # a tie: up to the even 1 + 2 ulp
        65504.0,
        65519.99,  # rounds down to 65504
        65520.0,  # rounds to inf, as torch does
        1e6,
        -1e6,
        2.0**-25,  # half the smallest subnormal: a tie, to 0
        3 * 2.0**-25,  # a tie between subnormals 1 and 2: to 2
        2.0**-14 - 2.0**-25,  # just below the smallest normal: rounds up into it
        6.1e-5,
        1e-9,
        float("inf"),
        float("-inf"),
        float("nan"),
        -0.0,
    ]
    return np.concatenate([f32(edge), codec_inputs()["wide"], codec_inputs()["normal"]])


def test_the_tab_encodes_every_codec_as_the_agent_does(tmp_path: Path) -> None:
    cases: list[dict[str, Any]] = []
    files: dict[str, bytes] = {}
    expected: dict[str, bytes] = {}
    for label, values in {**codec_inputs(), "fp16_edges": fp16_inputs()}.items():
        files[f"{label}.f32"] = values.tobytes()
        flat = torch.from_numpy(values.copy())
        finite = bool(np.isfinite(values).all())
        for codec, block in [("fp32", 256), ("fp16", 256), ("int8", 256), ("int8", 32), ("int8", 1000)]:
            if codec == "int8" and not finite:
                continue
            name = f"{label}-{codec}-{block}"
            cases.append({"name": name, "op": "encode", "codec": codec, "block": block, "input": f"{label}.f32"})
            if codec == "fp32":
                expected[name] = encode_fp32(flat)
            elif codec == "fp16":
                expected[name] = encode_fp16(flat)
            else:
                expected[name] = encode_int8(flat, block)

    results = run_vectors(tmp_path, cases, files)

    for name, payload in expected.items():
        ok(results[name])
        assert output(tmp_path, f"{name}.out") == payload, name
        assert ok(results[name])["size"] == len(payload), name


def test_the_tab_knows_each_codecs_size(tmp_path: Path) -> None:
    shapes = [
        (codec, n, block)
        for codec in ("fp32", "fp16", "int8")
        for n in (0, 1, 255, 256, 257, 10**6)
        for block in (32, 256)
    ]
    cases = [
        {"name": f"{codec}-{n}-{block}", "op": "encoded_size", "codec": codec, "n": n, "block": block}
        for codec, n, block in shapes
    ]
    cases.append({"name": "block too small", "op": "encoded_size", "codec": "int8", "n": 10, "block": 16})
    cases.append({"name": "unknown codec", "op": "encoded_size", "codec": "bf16", "n": 10, "block": 256})

    results = run_vectors(tmp_path, cases, {})

    for codec, n, block in shapes:
        assert ok(results[f"{codec}-{n}-{block}"]) == get_codec(codec, block).encoded_size(n)
    refused(results["block too small"], "CodecError", "block size 16 is out of bounds")
    refused(results["unknown codec"], "CodecError", "unknown codec")


def test_the_tab_refuses_to_int8_encode_a_gradient_that_is_not_finite(tmp_path: Path) -> None:
    files = {"nan.f32": f32([1.0, float("nan"), 2.0]).tobytes(), "inf.f32": f32([1.0, 2.0, float("inf")]).tobytes()}
    cases = [
        {"name": "nan", "op": "encode", "codec": "int8", "block": 256, "input": "nan.f32"},
        {"name": "inf", "op": "encode", "codec": "int8", "block": 256, "input": "inf.f32"},
    ]

    results = run_vectors(tmp_path, cases, files)

    refused(results["nan"], "CodecError", "element 1; it cannot be uploaded")
    refused(results["inf"], "CodecError", "give the lease back")


def test_int8_error_feedback_carries_the_agents_residuals(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    key = SliceKey(campaign_id=3, param_count=900, codec="int8", block_size=64, start=100, end=700)
    other_campaign = SliceKey(campaign_id=4, param_count=900, codec="int8", block_size=64, start=100, end=700)
    plan = [key, key, key, other_campaign, key]
    gradients = [f32(rng.standard_normal(600) * 10.0 ** rng.uniform(-4, 0)) for _ in plan]
    feedback = ErrorFeedback()
    codec = get_codec("int8", 64)
    payloads, residuals = [], []
    for slice_key, gradient in zip(plan, gradients, strict=True):
        payloads.append(feedback.encode(slice_key, torch.from_numpy(gradient.copy()), codec))
        residual = feedback.residual(slice_key)
        residuals.append(b"" if residual is None else residual.numpy().tobytes())
    uploads = [
        {
            "key": {
                "campaignId": k.campaign_id,
                "paramCount": k.param_count,
                "codec": k.codec,
                "blockSize": k.block_size,
                "start": k.start,
                "end": k.end,
            },
            "input": f"g{i}.f32",
        }
        for i, k in enumerate(plan)
    ]
    files = {f"g{i}.f32": g.tobytes() for i, g in enumerate(gradients)}

    results = run_vectors(tmp_path, [{"name": "fb", "op": "feedback", "uploads": uploads}], files)

    assert ok(results["fb"]) == len(plan)
    for i in range(len(plan)):
        assert output(tmp_path, f"fb.out.{i}") == payloads[i], f"upload {i}"
        assert output(tmp_path, f"fb.residual.{i}") == residuals[i], f"residual after upload {i}"


# ------------------------------------------------------------------ upload frames


def test_the_tab_frames_an_upload_as_the_agent_does(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    shapes = [
        ("fp32", 0, 256, 9),
        ("fp32", 100, 256, 9),
        ("fp32", (512 << 10) // 4, 256, 9),
        ("fp32", (512 << 10) // 4 + 1, 256, 9),
        ("fp16", 700_001, 256, 9),
        ("int8", 1_300_000, 64, 9),
        ("fp32", 5000, 128, 2),  # a 2.2 aggregator: no codec_block_size
    ]
    cases, files, expected = [], {}, {}
    for i, (codec, n, block, minor) in enumerate(shapes):
        size = int8_size(n, block) if codec == "int8" else get_codec(codec).encoded_size(n)
        payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        frames = split_payload(payload)
        begin = UploadBegin(
            ticket=f"ticket-{i}.sig",
            slice_index=i,
            codec=codec,
            num_elements=n,
            num_chunks=len(frames),
            codec_block_size=block,
        )
        files[f"p{i}.bin"] = payload
        expected[f"u{i}"] = (encode_message(begin, minor), frames)
        cases.append(
            {
                "name": f"u{i}",
                "op": "upload",
                "ticket": begin.ticket,
                "slice_index": i,
                "codec": codec,
                "block": block,
                "num_elements": n,
                "payload": f"p{i}.bin",
                "minor": minor,
            }
        )
    files["short.bin"] = b"\0" * 7
    cases.append(
        {
            "name": "short",
            "op": "upload",
            "ticket": "t",
            "slice_index": 0,
            "codec": "fp32",
            "block": 256,
            "num_elements": 2,
            "payload": "short.bin",
            "minor": 9,
        }
    )

    results = run_vectors(tmp_path, cases, files)

    for name, (text, frames) in expected.items():
        value = ok(results[name])
        assert value["text"] == text, name
        assert value["frames"] == len(frames), name
        assert value["bytes_up"] == sum(len(f) for f in frames), name
        for j, frame in enumerate(frames):
            assert output(tmp_path, f"{name}.frame.{j}") == frame, f"{name} frame {j}"
    refused(results["short"], "RangeError", "is 8 bytes, not 7")


# ------------------------------------------------------------------ parameter downloads


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def delta_headers(held_version: int, wanted: bytes) -> dict[str, str]:
    return {
        DELTA_FROM_HEADER: str(held_version),
        ENCODING_HEADER: ENCODING,
        CHECKSUM_HEADER: sha256(wanted),
        "ETag": '"v6-abc"',
    }


def two_versions(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A held version and the next, one optimizer-sized step apart, with a NaN payload to carry exactly."""
    rng = np.random.default_rng(seed)
    held = f32(rng.standard_normal(n) * 0.02)
    wanted = f32(held - 1e-3 * np.sign(rng.standard_normal(n)) * np.abs(held))
    bits = wanted.view(np.uint32)
    bits[n // 2] = 0x7FC01234  # a NaN with a payload
    return held, wanted


def params_case(
    name: str, body: str, headers: dict[str, str], n: int, held: str | None, version: int = 5
) -> dict[str, Any]:
    return {
        "name": name,
        "op": "params",
        "body": body,
        "headers": headers,
        "num_elements": n,
        "held": held,
        "held_version": version,
    }


def test_a_delta_download_rebuilds_the_version_the_agent_would(tmp_path: Path) -> None:
    held, wanted = two_versions(300_000, seed=1)
    small_held, small_wanted = two_versions(1000, seed=2)
    body = encode_delta(wanted.tobytes(), held.tobytes())
    small_body = encode_delta(small_wanted.tobytes(), small_held.tobytes())
    files = {
        "held.f32": held.tobytes(),
        "body.bin": body,
        "small_held.f32": small_held.tobytes(),
        "small_body.bin": small_body,
        "full.bin": wanted.tobytes(),
    }
    full_headers = {CHECKSUM_HEADER: sha256(wanted.tobytes()), "ETag": '"v6-full"'}
    cases = [
        params_case("delta", "body.bin", delta_headers(5, wanted.tobytes()), 300_000, "held.f32"),
        params_case("small", "small_body.bin", delta_headers(5, small_wanted.tobytes()), 1000, "small_held.f32"),
        params_case("full", "full.bin", full_headers, 300_000, "held.f32"),
        params_case("full, no checksum", "full.bin", {}, 300_000, None),
    ]

    results = run_vectors(tmp_path, cases, files)

    assert ok(results["delta"]) == {"delta": True, "etag": '"v6-abc"'}
    assert output(tmp_path, "delta.out") == wanted.tobytes()
    assert len(body) < 4 * 300_000  # a real delta, smaller than fp32
    assert output(tmp_path, "small.out") == small_wanted.tobytes()
    assert ok(results["full"]) == {"delta": False, "etag": '"v6-full"'}
    assert output(tmp_path, "full.out") == wanted.tobytes()
    assert output(tmp_path, "full, no checksum.out") == wanted.tobytes()


def test_the_tab_refuses_a_delta_it_cannot_trust(tmp_path: Path) -> None:
    n = 20_000
    held, wanted = two_versions(n, seed=3)
    body = encode_delta(wanted.tobytes(), held.tobytes())
    other_slice = encode_delta(wanted[:-1].tobytes(), held[:-1].tobytes())
    headers = delta_headers(5, wanted.tobytes())
    not_held = held.copy()
    not_held[7] += 1.0  # a rollback made version 5 again with other values
    damaged = bytearray(body)
    damaged[len(body) // 2 : len(body) // 2 + 64] = bytes(64)
    files = {
        "held.f32": held.tobytes(),
        "not_held.f32": not_held.tobytes(),
        "body.bin": body,
        "truncated.bin": body[:-10],
        "header_only.bin": body[:5],
        "padded.bin": body + b"\0\0\0\0",
        "other_slice.bin": other_slice,
        "huge.bin": bytes(4 * n + (4 * n) // 128 + 4097),
        "damaged.bin": bytes(damaged),
        "short_full.bin": wanted.tobytes()[:-4],
        "full.bin": wanted.tobytes(),
    }
    no_checksum = {k: v for k, v in headers.items() if k != CHECKSUM_HEADER}
    other_encoding = {**headers, ENCODING_HEADER: "xor-zlib"}
    wrong_checksum = {CHECKSUM_HEADER: sha256(held.tobytes())}
    cases = [
        params_case("another base version", "body.bin", delta_headers(6, wanted.tobytes()), n, "held.f32"),
        params_case("asked for none", "body.bin", headers, n, None),
        params_case("another encoding", "body.bin", other_encoding, n, "held.f32"),
        params_case("truncated", "truncated.bin", headers, n, "held.f32"),
        params_case("header only", "header_only.bin", headers, n, "held.f32"),
        params_case("padded", "padded.bin", headers, n, "held.f32"),
        params_case("another slice", "other_slice.bin", headers, n, "held.f32"),
        params_case("too large", "huge.bin", headers, n, "held.f32"),
        params_case("damaged", "damaged.bin", headers, n, "held.f32"),
        params_case("no checksum", "body.bin", no_checksum, n, "held.f32"),
        params_case("held other values", "body.bin", headers, n, "not_held.f32"),
        params_case("short full body", "short_full.bin", wrong_checksum, n, None),
        params_case("full body, wrong checksum", "full.bin", wrong_checksum, n, None),
    ]

    results = run_vectors(tmp_path, cases, files)

    refused(results["another base version"], "DeltaError", 'a delta from version "6"')
    refused(results["asked for none"], "DeltaError", "from no version was asked for")
    refused(results["another encoding"], "DeltaError", 'encoded as "xor-zlib"')
    refused(results["truncated"], "DeltaError", "is truncated")
    refused(results["header only"], "DeltaError", "has no valid zstd frame header")
    refused(results["padded"], "DeltaError", "has data after its zstd frame")
    refused(results["another slice"], "DeltaError", "it is a delta of another slice or version")
    refused(results["too large"], "DeltaError", "is larger than any delta")
    assert results["damaged"]["error"] == "DeltaError", results["damaged"]
    refused(results["no checksum"], "DeltaError", "without a checksum")
    refused(results["held other values"], "DeltaError", "the rebuilt parameters' sha256")
    refused(results["short full body"], "DownloadError", "it was cut short")
    refused(results["full body, wrong checksum"], "DownloadError", "damaged on the way")
    for name in ("truncated.bin", "padded.bin", "other_slice.bin", "huge.bin"):  # the agent refuses them too
        with pytest.raises(DeltaError):
            decode_delta(files[name], held.tobytes())


# ------------------------------------------------------------------ samples


def sample_case(
    name: str, data: DataSpec, shards: dict[str, str], ranges: list[SampleRange], micro: int, version: int = 0
) -> dict[str, Any]:
    return {
        "name": name,
        "op": "samples",
        "data": msgspec.to_builtins(data),
        "shards": shards,
        "ranges": [msgspec.to_builtins(r) for r in ranges],
        "microbatch_size": micro,
        "version": version,
    }


def expected_batches(
    data: DataSpec, shards: dict[str, bytes], ranges: list[SampleRange], micro: int, version: int
) -> list[Any]:
    """The agent's microbatches: its readers, its gather, then slices of ``micro`` samples, in the graph's dtypes."""
    readers = {sha: ShardReader(data, shard) for sha, shard in shards.items()}
    x, y = gather_samples(ranges, readers, augment=data.augment, version=version)
    batches = []
    for lo in range(0, len(x), micro):
        bx, by = x[lo : lo + micro], y[lo : lo + micro]
        batches.append((bx.to(torch.float32) if data.kind == "tensors" else bx, by))
    return batches


def assert_batches(tmp_path: Path, name: str, value: list[Any], batches: list[Any]) -> None:
    assert len(value) == len(batches), name
    for i, (bx, by) in enumerate(batches):
        x_type = "float32" if bx.dtype == torch.float32 else "int64"
        assert value[i] == {"x": [x_type, list(bx.shape)], "y": ["int64", list(by.shape)]}, f"{name} batch {i}"
        assert output(tmp_path, f"{name}.{i}.x") == bx.contiguous().numpy().tobytes(), f"{name} batch {i} x"
        assert output(tmp_path, f"{name}.{i}.y") == by.contiguous().numpy().tobytes(), f"{name} batch {i} y"


def named(shards: list[bytes]) -> dict[str, bytes]:
    return {sha256(shard): shard for shard in shards}


def test_the_tab_reads_a_leases_samples_as_the_agent_does(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    text = bytes(rng.integers(0, 256, 9 * 50, dtype=np.uint8))
    text_shards = named([shard for shard, _ in make_text_shards(text, sample_len=9, samples_per_shard=20)])
    narrow = named([rng.integers(0, 50_000, 6 * k, dtype=np.uint16).astype("<u2").tobytes() for k in (12, 5)])
    wide = named([rng.integers(0, 70_000, 4 * 10, dtype=np.uint32).astype("<u4").tobytes()])
    mlp = named([s for s, _ in make_tensor_shards(f32(rng.standard_normal((30, 8))), rng.integers(0, 10, 30), 16)])
    half = named(
        [
            s
            for s, _ in make_tensor_shards(
                rng.standard_normal((12, 3)).astype(np.float16), rng.integers(0, 4, 12).astype(np.int32), 12
            )
        ]
    )
    images = named(
        [
            s
            for s, _ in make_tensor_shards(
                rng.integers(0, 256, (10, 3, 8, 8), dtype=np.uint8), rng.integers(0, 5, 10), 10
            )
        ]
    )
    wide_images = named(
        [
            s
            for s, _ in make_tensor_shards(
                rng.integers(0, 256, (12, 1, 16, 16), dtype=np.uint8), rng.integers(0, 5, 12), 6
            )
        ]
    )
    leases = {
        "text": (DataSpec(kind="text", sample_len=9), text_shards, [(0, 3, 10), (1, 0, 7), (2, 9, 1)], 4),
        "tokens u16": (
            DataSpec(kind="tokens", sample_len=6, token_bytes=2, vocab_size=50_000),
            narrow,
            [(0, 2, 9), (1, 0, 5)],
            5,
        ),
        "tokens u32": (
            DataSpec(kind="tokens", sample_len=4, token_bytes=4, vocab_size=70_000),
            wide,
            [(0, 1, 8)],
            3,
        ),
        "mlp": (DataSpec(kind="tensors"), mlp, [(1, 2, 10), (0, 0, 16)], 7),
        "fp16 features": (DataSpec(kind="tensors"), half, [(0, 0, 12)], 5),
        "images": (DataSpec(kind="tensors"), images, [(0, 4, 6)], 4),
        "images flipped": (DataSpec(kind="tensors", augment="flip"), images, [(0, 0, 10)], 4),
        "images flipped and shifted": (DataSpec(kind="tensors", augment="flip_crop"), images, [(0, 1, 9)], 5),
        "wide images shifted": (DataSpec(kind="tensors", augment="flip_crop"), wide_images, [(1, 2, 4), (0, 0, 6)], 3),
    }
    cases, files, expected = [], {}, {}
    for name, (data, shards, spans, micro) in leases.items():
        shas = list(shards)
        ranges = [SampleRange(shard=shas[i], start=start, count=count) for i, start, count in spans]
        files.update({f"{sha}.shard": shard for sha, shard in shards.items()})
        cases.append(sample_case(name, data, {sha: f"{sha}.shard" for sha in shas}, ranges, micro, version=17))
        expected[name] = expected_batches(data, shards, ranges, micro, version=17)

    results = run_vectors(tmp_path, cases, files)

    for name, batches in expected.items():
        assert_batches(tmp_path, name, ok(results[name]), batches)


def test_the_tab_refuses_samples_the_agent_refuses(tmp_path: Path) -> None:
    text_shard = bytes(range(90))
    out_of_vocab = np.array([1, 2, 3, 60_000], dtype="<u2").tobytes()
    ragged = np.arange(7, dtype="<u2").tobytes()
    features = named([s for s, _ in make_tensor_shards(np.zeros((4, 3), dtype=np.float32), np.zeros(4), 4)])
    text_sha, vocab_sha, ragged_sha = sha256(text_shard), sha256(out_of_vocab), sha256(ragged)
    features_sha = next(iter(features))
    files = {
        "text": text_shard,
        "vocab": out_of_vocab,
        "ragged": ragged,
        "features": features[features_sha],
        "junk": b"\x10" + bytes(20),
    }
    text = DataSpec(kind="text", sample_len=9)
    tokens = DataSpec(kind="tokens", sample_len=2, token_bytes=2, vocab_size=50_000)
    cases = [
        sample_case("outside", text, {text_sha: "text"}, [SampleRange(shard=text_sha, start=5, count=6)], 4),
        sample_case("vocabulary", tokens, {vocab_sha: "vocab"}, [SampleRange(shard=vocab_sha, start=0, count=1)], 4),
        sample_case("ragged", tokens, {ragged_sha: "ragged"}, [SampleRange(shard=ragged_sha, start=0, count=1)], 4),
        sample_case(
            "not images",
            DataSpec(kind="tensors", augment="flip"),
            {features_sha: "features"},
            [SampleRange(shard=features_sha, start=0, count=2)],
            4,
        ),
        sample_case(
            "junk",
            DataSpec(kind="tensors"),
            {features_sha: "junk"},
            [SampleRange(shard=features_sha, start=0, count=1)],
            4,
        ),
    ]
    with pytest.raises(ProtocolError, match="outside a shard of 10 samples"):  # the agent refuses the same
        ShardReader(text, text_shard).read(5, 6)

    results = run_vectors(tmp_path, cases, files)

    refused(results["outside"], "SampleError", "sample range 5+6 lies outside a shard of 10 samples")
    refused(results["vocabulary"], "SampleError", "id 60000, outside the vocabulary of 50000")
    refused(results["ragged"], "SampleError", "is not whole samples of 4 bytes")
    refused(
        results["not images"], "SampleError", "augmentation applies to images (N, C, H, W); these samples are [2,3]"
    )
    refused(results["junk"], "SampleError", "not a valid safetensors file")


# ------------------------------------------------------------------ control messages

TICKET = "eyJsZWFzZV9pZCI6IDF9.c2lnbmF0dXJl"


def full_lease() -> Lease:
    return Lease(
        lease_id=41,
        campaign_id=7,
        base_version=12,
        ranges=[SampleRange(shard="a" * 64, start=0, count=32), SampleRange(shard="b" * 64, start=96, count=16)],
        num_samples=48,
        microbatch_size=16,
        deadline_s=90.5,
        ticket=TICKET,
        codec="int8",
        model=ModelSpec(architecture="gpt", config={"n_layer": 2, "dropout": 0.0, "name": "tiny", "sizes": [1, 2.5]}),
        data=DataSpec(kind="tokens", sample_len=65, token_bytes=2, vocab_size=50_257, tokenizer="c" * 64),
        param_count=123_456,
        slices=[
            SliceRoute(index=0, start=0, end=60_000, upload_url="ws://a:1/up/", params_url="http://a:1/params/7/0/"),
            SliceRoute(
                index=1, start=60_000, end=123_456, upload_url="ws://b:1/up/", params_url="http://b:1/params/7/1/"
            ),
        ],
        prefetch=["d" * 64],
        codec_block_size=128,
        mode="local",
        inner=OptimizerSpec(
            name="adamw", lr=3e-4, warmup_steps=10, schedule="cosine", total_steps=1000, extra={"k": 1.5}
        ),
        inner_batch_size=32,
        rebase_to=13,
        mixed_precision=True,
    )


def site_messages() -> dict[str, msgspec.Struct]:
    return {
        "lease": full_lease(),
        "plain lease": Lease(
            lease_id=1,
            campaign_id=2,
            base_version=0,
            ranges=[SampleRange(shard="e" * 64, start=0, count=4)],
            num_samples=4,
            microbatch_size=4,
            deadline_s=30,
            ticket=TICKET,
            codec="fp32",
            model=ModelSpec(architecture="mlp", config={}),
            data=DataSpec(kind="text", sample_len=33),
            param_count=10,
            slices=[SliceRoute(index=0, start=0, end=10, upload_url="ws://a/", params_url="http://a/")],
        ),
        "no_lease": NoLease(reason="step_full", detail="step 3 is full", retry_after_s=2.5, ready_at_step=4),
        "quarantined": NoLease(reason="quarantined", detail="results disagreed; appeal at /appeal", retry_after_s=600),
        "done_ack": DoneAck(lease_id=41, accepted=True, step=12, verification="pending"),
        "done_ack refused": DoneAck(lease_id=41, accepted=False, reason="lease expired: deadline passed"),
        "welcome": Welcome(
            device_id=9,
            device_name="Firefox on Linux (tab)",
            volunteer="vera",
            heartbeat_s=25,
            gone_after_s=60,
            controls=DeviceControls(schedule="mon-fri 18:00-08:00", upload_kbps=512.0, threads=4),
        ),
        "error": ErrorMessage(code="malformed json", detail="expecting value"),
    }


def aggregator_messages() -> dict[str, msgspec.Struct]:
    return {
        "receipt": UploadReceipt(lease_id=41, slice_index=1, token="cmVjZWlwdA"),
        "upload_rejected": UploadRejected(lease_id=None, slice_index=None, code="bad ticket", detail="expired"),
        "upload_rejected for a slice": UploadRejected(lease_id=41, slice_index=0, code="stale version", detail="v3"),
    }


def test_the_tab_reads_what_the_site_and_aggregators_send(tmp_path: Path) -> None:
    channels = {**{k: ("site", m) for k, m in site_messages().items()}}
    channels.update({k: ("aggregator", m) for k, m in aggregator_messages().items()})
    cases = [{"name": k, "op": "parse", "channel": ch, "text": encode_message(m)} for k, (ch, m) in channels.items()]
    newer = json.loads(encode_message(full_lease()))
    newer["from_the_future"] = 1
    newer["data"]["shards_per_epoch"] = 3
    newer["ranges"][1]["weight"] = 0.5
    cases.append({"name": "newer lease", "op": "parse", "channel": "site", "text": json.dumps(newer)})

    results = run_vectors(tmp_path, cases, {})

    for name, (_, message) in channels.items():
        value = ok(results[name])
        assert value["message"] == msgspec.to_builtins(message), name
        assert value["ignored"] is None, name
    newer_value = ok(results["newer lease"])
    assert newer_value["message"] == msgspec.to_builtins(full_lease())
    assert newer_value["ignored"] == {
        "kind": "lease",
        "fields": ["ranges[1].weight", "data.shards_per_epoch", "from_the_future"],
    }


def test_the_tab_refuses_what_the_agent_refuses(tmp_path: Path) -> None:
    lease = json.loads(encode_message(full_lease()))
    no_ticket = {k: v for k, v in lease.items() if k != "ticket"}
    negative = json.loads(json.dumps(lease))
    negative["ranges"][0]["start"] = -1
    bad_codec = {**lease, "codec": "bf16"}
    bad_block = {**lease, "codec_block_size": 16}
    huge_id = {**lease, "lease_id": 2**60}
    texts = {
        "missing ticket": ("site", json.dumps(no_ticket)),
        "negative start": ("site", json.dumps(negative)),
        "unknown codec": ("site", json.dumps(bad_codec)),
        "block too small": ("site", json.dumps(bad_block)),
        "id past 2**53": ("site", json.dumps(huge_id)),
        "receipt on the control channel": ("site", encode_message(UploadReceipt(lease_id=1, slice_index=0, token="t"))),
        "a tab's own kind": ("site", encode_message(Heartbeat())),
        "a kind of the backbone": ("site", json.dumps({"kind": "commit", "campaign_id": 1})),
        "malformed": ("site", "{not json"),
        "an array": ("site", "[1, 2]"),
        "too large": ("site", json.dumps({"kind": "error", "code": "x", "detail": "y" * (64 << 10)})),
    }
    cases = [{"name": k, "op": "parse", "channel": ch, "text": t} for k, (ch, t) in texts.items()]
    for name, (channel, text) in texts.items():  # the agent refuses every one of them too
        if name != "id past 2**53":
            with pytest.raises(ProtocolError):
                decode_message(text, allowed=(Lease, ErrorMessage) if channel == "site" else None)

    results = run_vectors(tmp_path, cases, {})

    refused(results["missing ticket"], "ProtocolError", "Lease: missing field 'ticket'")
    refused(results["negative start"], "ProtocolError", "Lease.ranges[0].start: expected int >= 0")
    refused(results["unknown codec"], "ProtocolError", 'Lease.codec: invalid enum value "bf16"')
    refused(results["block too small"], "ProtocolError", "Lease.codec_block_size: expected int >= 32")
    refused(results["id past 2**53"], "ProtocolError", "is past what this tab reads exactly (2**53)")
    assert results["id past 2**53"]["message"].startswith("Lease.lease_id: ")
    refused(results["receipt on the control channel"], "ProtocolError", "is not accepted on this channel")
    refused(results["a tab's own kind"], "ProtocolError", 'message kind "heartbeat" is not accepted on this channel')
    refused(results["a kind of the backbone"], "ProtocolError", 'unknown message kind "commit"')
    refused(results["malformed"], "ProtocolError", "malformed json")
    refused(results["an array"], "ProtocolError", "expected a JSON object, got an array")
    refused(results["too large"], "ProtocolError", "over the 65536 byte limit")


def test_the_site_reads_what_the_tab_sends(tmp_path: Path) -> None:
    device = {
        "kind": "cpu",
        "name": "Firefox 140 on Linux (tab)",
        "memory_bytes": 8 << 30,
        "threads": 8,
        "flops_per_s": 2.5e10,
    }
    receipts = [{"slice_index": 0, "token": "cmVjZWlwdA"}, {"slice_index": 1, "token": "b3RoZXI"}]
    done_fields = {
        "lease_id": 41,
        "receipts": receipts,
        "num_samples": 48,
        "loss_sum": 131.25,
        "compute_s": 12.5,
        "bytes_up": 250_000,
        "bytes_down": 1_000_000,
        "network_s": 0.75,
    }
    sends = {
        "hello": ({"agentVersion": "crowdtrain-tab 0.1", "device": device}, 9),
        "heartbeat": ({}, 9),
        "lease_request": ({"campaign_id": 7, "samples_per_s": 120.5, "request_id": "r-1", "wait_s": 10}, 9),
        "lease_request any": ({}, 9),
        "done": (done_fields, 9),
        "done to a 2.2 site": (done_fields, 2),
        "release": ({"lease_id": 41}, 9),
    }
    cases: list[dict[str, Any]] = [
        {"name": name, "op": "send", "kind": name.split()[0], "fields": fields, "minor": minor}
        for name, (fields, minor) in sends.items()
    ]
    cases.append(
        {
            "name": "browser hello",
            "op": "send",
            "kind": "hello",
            "fields": {"agentVersion": "t", "device": {"name": "tab", "runtime": "onnxruntime-web 1.30.0 wasm"}},
        }
    )
    cases.append(
        {
            "name": "browser hello to a 2.9 site",
            "op": "send",
            "kind": "hello",
            "fields": {"agentVersion": "t", "device": {"name": "tab", "runtime": "onnxruntime-web 1.30.0 wasm"}},
            "minor": 9,
        }
    )
    cases.append(
        {
            "name": "loss out of bounds",
            "op": "send",
            "kind": "done",
            "fields": {**done_fields, "loss_sum": 1e31},
            "minor": 9,
        }
    )
    cases.append(
        {"name": "unknown field", "op": "send", "kind": "release", "fields": {"lease_id": 1, "why": "x"}, "minor": 9}
    )
    expected = {
        "hello": AgentHello(protocol_version=2, agent_version="crowdtrain-tab 0.1", device=DeviceInfo(**device)),
        "heartbeat": Heartbeat(),
        "lease_request": LeaseRequest(campaign_id=7, samples_per_s=120.5, request_id="r-1", wait_s=10.0),
        "lease_request any": LeaseRequest(),
        "done": LeaseDone(**{**done_fields, "receipts": [Receipt(**r) for r in receipts]}),
        "done to a 2.2 site": LeaseDone(
            lease_id=41, receipts=[Receipt(**r) for r in receipts], num_samples=48, loss_sum=131.25, compute_s=12.5
        ),
        "release": LeaseRelease(lease_id=41),
    }

    results = run_vectors(tmp_path, cases, {})

    for name, message in expected.items():
        text = ok(results[name])
        assert decode_message(text, allowed=AGENT_TO_SITE) == message, name
    assert "bytes_up" not in json.loads(ok(results["done to a 2.2 site"]))
    # Protocol 2.10 reads a "browser" device and what computes in it; a 2.9 site is never sent the runtime.
    browser_hello = ok(results["browser hello"])
    assert json.loads(browser_hello)["device"]["kind"] == "browser"
    assert "runtime" not in json.loads(ok(results["browser hello to a 2.9 site"]))["device"]
    device_seen = decode_message(browser_hello, allowed=AGENT_TO_SITE).device  # type: ignore[union-attr]
    assert (device_seen.kind, device_seen.runtime) == ("browser", "onnxruntime-web 1.30.0 wasm")
    refused(results["loss out of bounds"], "ProtocolError", "LeaseDone.loss_sum: expected float <= 1e+30")
    refused(results["unknown field"], "ProtocolError", "LeaseRelease: no such field why")
