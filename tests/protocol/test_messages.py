"""Messages: every kind round-trips, decoding is total, bounds hold, and minors stay compatible both ways."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crowdtrain_agent.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_MINOR,
    AgentHello,
    DeviceInfo,
    LeaseDone,
    ProtocolError,
    choose_subprotocol,
    decode_message,
    encode_message,
    negotiated_minor,
    offered_subprotocols,
)
from crowdtrain_agent.protocol.messages import (
    AGENT_TO_SITE,
    ALL_MESSAGES,
    BACKBONE_TO_SITE,
    SliceAssignment,
)
from crowdtrain_agent.protocol.schema import lost_in, newest_field

from .strategies import ANY_JSON, strategy_for

KINDS = sorted(MESSAGE_TYPES)


@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_every_message_survives_a_round_trip(kind: str, data: st.DataObject) -> None:
    message = data.draw(strategy_for(MESSAGE_TYPES[kind]))

    decoded = decode_message(encode_message(message))

    assert decoded == message


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        ("{", "malformed json"),
        ("[1, 2]", "expected a JSON object, got an array"),
        ('{"kind": "nope"}', "unknown message kind 'nope'"),
        ('{"kind": "done", "lease_id": 1}', "LeaseDone: missing field 'receipts'"),
        (
            '{"kind": "done", "lease_id": true, "receipts": [], "num_samples": 1, "loss_sum": 1, "compute_s": 1}',
            "LeaseDone.lease_id: expected int, got bool",
        ),
        (
            '{"kind": "done", "lease_id": 1, "receipts": [], "num_samples": 1, "loss_sum": NaN, "compute_s": 1}',
            "malformed json",
        ),
        ('{"kind": "no_lease", "reason": "bored", "detail": "", "retry_after_s": 1}', "NoLease.reason: invalid enum"),
        # What a fuzzer sent: each was an exception (close 1011) or a 500 before, now a named refusal.
        ('{"kind": "lease_request", "wait_s": ' + "9" * 400 + "}", "LeaseRequest.wait_s: number out of range"),
        ('{"kind": "lease_request", "samples_per_s": 1e308}', "LeaseRequest.samples_per_s: expected float <="),
        ('{"kind": "lease_request", "samples_per_s": 1e999}', "Number out of range"),
        ('{"kind": "lease_request", "request_id": "\\ud800"}', "malformed json"),
        (
            '{"kind": "lease_request", "request_id": "' + "x" * 65 + '"}',
            "LeaseRequest.request_id: expected str of length <= 64",
        ),
        (
            '{"kind": "done", "lease_id": -1, "receipts": [], "num_samples": 1, "loss_sum": 1, "compute_s": 1}',
            "LeaseDone.lease_id: expected int >= 0",
        ),
        (
            '{"kind": "hello", "agent_version": "x", "device": {"kind": "cpu", "name": "n"}}',
            "AgentHello: missing field 'protocol_version'",
        ),
        (
            '{"kind": "hello", "protocol_version": 2, "agent_version": "x", "device": {"kind": "cpu", "name": "n", '
            '"memory_bytes": 1' + "0" * 400 + "}}",
            "AgentHello.device.memory_bytes: expected int <=",
        ),
        (
            '{"kind": "hello", "protocol_version": 2, "agent_version": "x", "device": ' + "[" * 5000 + "]" * 5000 + "}",
            "message.device: expected object, got array",
        ),
        ("[" * 30000 + "]" * 30000, "message: expected object, got array"),
        ('{"kind": "hello", "x": ' + "[" * 30000 + "]" * 30000 + "}", "malformed json: nested deeper than any message"),
    ],
)
def test_it_names_what_is_wrong_with_a_bad_frame(frame: str, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem.replace("[", r"\[")) as info:
        decode_message(frame)

    assert not info.value.fatal


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(frame=st.one_of(st.binary(max_size=300), st.text(max_size=300), ANY_JSON.map(json.dumps)))
def test_decoding_is_total_for_any_bytes_or_json(frame: str | bytes) -> None:
    # A message or the protocol's own error: never another exception.
    for allowed in (None, AGENT_TO_SITE, BACKBONE_TO_SITE):
        try:
            message = decode_message(frame, allowed)
        except ProtocolError:
            continue
        assert isinstance(message, ALL_MESSAGES)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(KINDS))
def test_any_json_in_any_field_of_any_message_is_a_message_or_a_named_error(data: st.DataObject, kind: str) -> None:
    # A valid message with one field replaced by arbitrary JSON: the decoder stays total and names that field.
    fields = msgspec.to_builtins(data.draw(strategy_for(MESSAGE_TYPES[kind])))
    names = [name for name in fields if name != "kind"]
    if not names:
        return
    name = data.draw(st.sampled_from(names))
    fields[name] = data.draw(ANY_JSON)
    try:
        decode_message(json.dumps(fields))
    except ProtocolError as exc:
        assert f".{name}" in str(exc) or "missing field" in str(exc) or "malformed json" in str(exc), str(exc)


def test_fields_of_a_newer_minor_are_ignored_and_reported() -> None:
    frame = json.dumps(
        {
            "kind": "done",
            "lease_id": 1,
            "receipts": [{"slice_index": 0, "token": "t", "proof": "from 2.9"}],
            "num_samples": 1,
            "loss_sum": 1.0,
            "compute_s": 0.5,
            "flavour": "new",
        }
    )
    reported: list[tuple[str, list[str]]] = []

    message = decode_message(frame, AGENT_TO_SITE, unknown=lambda kind, fields: reported.append((kind, fields)))

    assert isinstance(message, LeaseDone) and message.receipts[0].token == "t"
    assert reported == [("done", ["flavour", "receipts[0].proof"])]


def test_it_refuses_a_message_kind_not_meant_for_the_channel() -> None:
    frame = encode_message(LeaseDone(lease_id=1, receipts=[], num_samples=1, loss_sum=0.0, compute_s=0.0))

    with pytest.raises(ProtocolError, match="not accepted on this channel"):
        decode_message(frame, allowed=BACKBONE_TO_SITE)


def test_oversized_control_messages_are_refused_by_bytes_and_close_the_connection() -> None:
    ascii_frame = json.dumps({"kind": "heartbeat", "pad": "x" * (1 << 17)})
    # 30,000 three-byte characters: 90 KB on the wire, although only 30,000 characters long.
    wide_frame = json.dumps({"kind": "heartbeat", "pad": "€" * 30_000}, ensure_ascii=False)

    for frame in (ascii_frame, wide_frame):
        with pytest.raises(ProtocolError, match="over the 65536 byte limit") as info:
            decode_message(frame)
        assert info.value.close_code == 4008 and info.value.fatal


def test_a_field_a_minor_added_is_left_out_for_a_peer_of_an_older_minor() -> None:
    assert {"codec": 1, "ticket_key": 1}.items() <= SliceAssignment.since.items()
    message = msgspec.convert(
        {
            "campaign_id": 1,
            "slice_index": 0,
            "start": 0,
            "end": 4,
            "param_count": 8,
            "model": {"architecture": "mlp", "config": {"hidden": [4]}},
            "optimizer": {},
            "seed": 1,
            "version": 0,
            "staleness": 1,
            "checkpoint_every": 0,
            "max_grad_norm": 0.0,
            "codec": "fp16",
        },
        SliceAssignment,
    )

    for_old = json.loads(encode_message(message, minor=0))
    for_new = json.loads(encode_message(message, minor=1))

    assert "codec" not in for_old and for_new["codec"] == "fp16"
    # A 2.0 peer refused unknown fields: what it gets decodes strictly, with no field ignored.
    reported: list[object] = []
    assert decode_message(json.dumps(for_old), unknown=lambda *a: reported.append(a)).codec is None
    assert reported == []


def _assignment(**fields: object) -> SliceAssignment:
    base = {"campaign_id": 1, "slice_index": 0, "start": 0, "end": 4, "param_count": 8,
            "model": {"architecture": "mlp", "config": {"hidden": [4]}}, "optimizer": {}, "seed": 1, "version": 0,
            "staleness": 1, "checkpoint_every": 0, "max_grad_norm": 0.0}  # fmt: skip
    return msgspec.convert({**base, **fields}, SliceAssignment)


def test_the_robust_aggregation_settings_came_with_minor_2() -> None:
    message = _assignment(aggregation="centered_clip", clip_factor=4.0, trim_fraction=0.2)

    for_1 = json.loads(encode_message(message, minor=1))
    for_2 = json.loads(encode_message(message, minor=2))

    assert {"aggregation": 2, "clip_factor": 2, "trim_fraction": 2}.items() <= SliceAssignment.since.items()
    assert newest_field(SliceAssignment) >= 2 and PROTOCOL_MINOR >= 2
    assert not {"aggregation", "clip_factor", "trim_fraction"} & set(for_1)
    assert (for_2["aggregation"], for_2["clip_factor"], for_2["trim_fraction"]) == ("centered_clip", 4.0, 0.2)


def test_a_robust_mean_is_never_sent_stripped_but_a_clip_factor_may_be() -> None:
    robust = _assignment(aggregation="trimmed_mean", trim_fraction=0.2)
    clipped = _assignment(clip_factor=3.0, trim_fraction=0.3)

    # A 2.1 aggregator would take the plain mean: the site must not assign it a trimmed-mean slice.
    assert lost_in(robust, 1) == ["aggregation"]
    # It only loses a defence with the clip factor, and a trim fraction means nothing with the plain mean.
    assert lost_in(clipped, 1) == [] and lost_in(robust, 2) == []


def test_both_sides_pick_the_newest_minor_they_share() -> None:
    assert offered_subprotocols() == [f"crowdtrain.2.{PROTOCOL_MINOR}", f"crowdtrain.2.{PROTOCOL_MINOR - 1}"]
    # A site of the same minor; a site pinned one minor back (a rolling upgrade); a 2.0 site, which picks none.
    assert choose_subprotocol(offered_subprotocols()) == (f"crowdtrain.2.{PROTOCOL_MINOR}", PROTOCOL_MINOR)
    assert choose_subprotocol(offered_subprotocols(), newest=PROTOCOL_MINOR - 1)[1] == PROTOCOL_MINOR - 1
    assert negotiated_minor(None) == 0
    # An agent of 2.0 offers none; one from the future offers only minors this site does not know.
    assert choose_subprotocol([]) == (None, 0)
    assert choose_subprotocol(["crowdtrain.2.99", "crowdtrain.3.0", "chat"]) == (None, 0)


def test_every_kind_has_exactly_one_class_and_one_tag() -> None:
    assert len(MESSAGE_TYPES) == len(ALL_MESSAGES)
    assert all(MESSAGE_TYPES[cls.__struct_config__.tag] is cls for cls in ALL_MESSAGES)


def test_every_message_class_is_exported_by_the_protocol_package() -> None:
    import crowdtrain_agent.protocol as package
    from crowdtrain_agent.protocol import messages

    for cls in MESSAGE_TYPES.values():
        assert cls.__name__ in messages.__all__
        assert getattr(package, cls.__name__) is cls


def test_the_int8_codec_and_its_block_size_came_with_minor_3() -> None:
    message = _assignment(codec="int8", codec_block_size=128)

    for_2 = json.loads(encode_message(message, minor=2))
    for_3 = json.loads(encode_message(message, minor=3))

    assert SliceAssignment.since["codec_block_size"] == 3 and PROTOCOL_MINOR >= 3
    assert "codec_block_size" not in for_2
    assert (for_3["codec"], for_3["codec_block_size"]) == ("int8", 128)
    assert decode_message(encode_message(message)) == message


def test_an_int8_campaign_is_never_sent_to_a_peer_that_cannot_read_the_codec() -> None:
    int8 = _assignment(codec="int8")
    fp16 = _assignment(codec="fp16", codec_block_size=64)  # a block size means nothing without int8

    assert lost_in(int8, 2) == ["codec=int8"] and lost_in(int8, 3) == []
    assert lost_in(fp16, 0) == lost_in(fp16, 2) == []


@pytest.mark.parametrize("size", [31, 65537])
def test_a_block_size_out_of_bounds_is_refused_by_the_decoder(size: int) -> None:
    text = json.dumps({**json.loads(encode_message(_assignment(codec="int8"))), "codec_block_size": size})

    with pytest.raises(ProtocolError, match="codec_block_size"):
        decode_message(text)


def test_a_browser_device_and_its_runtime_came_with_minor_10() -> None:
    tab = AgentHello(
        protocol_version=2, agent_version="crowdtrain-tab 0.1",
        device=DeviceInfo(kind="browser", name="Chromium tab", runtime="onnxruntime-web 1.30.0 wasm"),
    )  # fmt: skip
    agent = AgentHello(
        protocol_version=2, agent_version="test", device=DeviceInfo(kind="cpu", name="cpu", runtime="torch 2.13.0")
    )

    assert PROTOCOL_MINOR >= 10 and DeviceInfo.since_values == {"kind": {"browser": 10}}
    assert decode_message(encode_message(tab), allowed=AGENT_TO_SITE) == tab
    # A 2.9 site's decoder refuses kind "browser": such a hello must not go to it, runtime or not.
    assert lost_in(tab, 9) == ["device.kind=browser"] and lost_in(tab, 10) == []
    # The runtime is only shown: an agent's hello to a 2.9 site leaves it out and means the same.
    assert lost_in(agent, 9) == []
    assert "runtime" not in json.loads(encode_message(agent, 9))["device"]
    assert json.loads(encode_message(agent))["device"]["runtime"] == "torch 2.13.0"
