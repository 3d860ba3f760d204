"""Every JSON message of the Crowdtrain protocol, shared by agent, site and aggregator.

Three channels carry them (see agent/PROTOCOL.md):

- control, agent <-> site, ``/ws/agent/``: hello, heartbeats, leases, done reports;
- backbone, aggregator <-> site, ``/ws/backbone/``: slice assignments, step commits;
- data, agent -> aggregator: an ``upload`` header followed by binary chunks.

Each message is a frozen dataclass whose ``kind`` field is its wire tag.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, Union

from .errors import ProtocolError
from .frames import MAX_CONTROL_MESSAGE_BYTES, PROTOCOL_VERSION, CloseCode
from .schema import from_dict, to_dict

M = TypeVar("M")

CodecName = Literal["fp32", "fp16"]
DeviceKind = Literal["cpu", "cuda", "mps"]

# ---------------------------------------------------------------- shared parts


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """Hardware an agent reports; shown on the volunteer's device page."""

    kind: DeviceKind
    name: str
    memory_bytes: int = 0
    threads: int = 1
    torch_version: str = ""
    flops_per_s: float = 0.0  # measured by a short matmul benchmark at start-up


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """An architecture from the agent's model registry and its keyword arguments."""

    architecture: str
    config: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """How to turn a shard's bytes into samples.

    ``text``: raw bytes, ``sample_len`` bytes per sample (inputs are the first
    ``sample_len - 1``, targets the last ``sample_len - 1``).
    ``tensors``: a safetensors file with arrays ``x`` and ``y``, one row per sample.
    """

    kind: Literal["text", "tensors"]
    sample_len: int = 0


@dataclass(frozen=True, kw_only=True)
class SampleRange:
    """``count`` consecutive samples of one shard, starting at sample ``start``."""

    shard: str  # sha256 hex of the shard's bytes
    start: int
    count: int


@dataclass(frozen=True, kw_only=True)
class SliceRoute:
    """Where slice ``index`` (elements ``start:end`` of the flat parameter vector) lives."""

    index: int
    start: int
    end: int
    upload_url: str  # ws:// URL of the aggregator's data channel
    params_url: str  # http:// URL prefix; GET {params_url}{version} returns the slice


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The optimizer the aggregators apply to their slices, and its learning-rate schedule.

    AdamW and SGD are elementwise, so slices compose to the full model. LAMB
    scales each parameter tensor's update by a trust ratio of norms, so a
    LAMB campaign's slices are cut at tensor boundaries. ``beta1``, ``beta2``
    and ``eps`` serve AdamW and LAMB; ``momentum`` serves SGD.

    The learning rate of step ``s`` is ``lr * lr_multiplier(s)``: a linear
    warmup over ``warmup_steps``, then constant, or a cosine decay that
    reaches ``lr * min_lr_ratio`` at ``total_steps`` and stays there.
    """

    name: Literal["adamw", "sgd", "lamb"] = "adamw"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    total_steps: int | None = None  # the site fills it from the campaign's max_steps

    def lr_multiplier(self, step: int) -> float:
        """The factor on ``lr`` for step ``step`` (0-based; the step that makes version ``step + 1``).

        Warmup gives step ``s < warmup_steps`` the factor ``(s + 1) / warmup_steps``,
        so the first step already moves and step ``warmup_steps - 1`` runs at
        full rate. The cosine then falls from 1 at ``warmup_steps`` to
        ``min_lr_ratio`` at ``total_steps``. A step count is the parameter
        version, so a slice restored from a checkpoint resumes the schedule
        where it was.

        Args:
            step: the index of the step about to be applied.

        Returns:
            A factor in ``[0, 1]`` (``min_lr_ratio`` is assumed to be in ``[0, 1]``).
        """
        step = max(0, step)
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant" or self.total_steps is None:
            return 1.0
        span = self.total_steps - self.warmup_steps
        progress = 1.0 if span <= 0 else min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


@dataclass(frozen=True, kw_only=True)
class Receipt:
    """An aggregator's signed proof that it holds one slice of a lease's gradient."""

    slice_index: int
    token: str


# ------------------------------------------------------ control: agent <-> site


@dataclass(frozen=True, kw_only=True)
class AgentHello:
    kind: Literal["hello"] = "hello"
    protocol_version: int = PROTOCOL_VERSION
    agent_version: str
    device: DeviceInfo


@dataclass(frozen=True, kw_only=True)
class Welcome:
    kind: Literal["welcome"] = "welcome"
    device_id: int
    device_name: str
    volunteer: str
    heartbeat_s: float
    gone_after_s: float


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """Sent every HEARTBEAT_INTERVAL_S by agents and aggregators; no reply."""

    kind: Literal["heartbeat"] = "heartbeat"


@dataclass(frozen=True, kw_only=True)
class LeaseRequest:
    kind: Literal["lease_request"] = "lease_request"
    campaign_id: int | None = None  # None: any running campaign
    samples_per_s: float | None = None  # measured on that campaign's model; None until known
    request_id: str = ""  # the same for a resent request, so the site answers with the same lease (max 64)
    # How long the site may hold the request when every step this device may work on is full: it
    # answers the moment a commit makes room, instead of the agent asking again and again. 0: at once.
    wait_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Lease:
    """One assignment of sample ranges to one agent, with a deadline."""

    kind: Literal["lease"] = "lease"
    lease_id: int
    campaign_id: int
    # Parameter version to compute the gradient against: the newest committed step's, which the
    # aggregators may still be applying (their parameter downloads wait for it a few seconds).
    base_version: int
    ranges: list[SampleRange]
    num_samples: int
    microbatch_size: int
    deadline_s: float  # seconds from now; relative so clock skew does not matter
    ticket: str
    codec: CodecName
    model: ModelSpec
    data: DataSpec
    param_count: int
    slices: list[SliceRoute]
    # Shards the campaign's next leases will read (sha256): fetched ahead, while this lease computes,
    # so a lease seldom waits for its data. Agents take the first few.
    prefetch: list[str] = field(default_factory=list)


NoLeaseReason = Literal[
    "no_campaign",  # nothing is running that this device may join
    "campaign_paused",  # the campaign exists but is paused or waits for aggregators
    "step_full",  # the open step has all the samples it needs; wait for its commit
    "epoch_done",  # every sample of the epoch is leased; wait for stragglers
    "campaign_finished",
]


@dataclass(frozen=True, kw_only=True)
class NoLease:
    """Why no lease was given, and when to ask again."""

    kind: Literal["no_lease"] = "no_lease"
    reason: NoLeaseReason
    detail: str
    retry_after_s: float
    # For "step_full": asking again can succeed once the campaign has committed this many steps.
    ready_at_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class LeaseDone:
    kind: Literal["done"] = "done"
    lease_id: int
    receipts: list[Receipt]
    num_samples: int
    loss_sum: float  # sum over samples of each sample's mean token loss
    compute_s: float


@dataclass(frozen=True, kw_only=True)
class DoneAck:
    kind: Literal["done_ack"] = "done_ack"
    lease_id: int
    accepted: bool
    step: int | None = None  # the step the samples count in, when accepted
    reason: str = ""  # why not, when rejected ("lease expired", "stale version", ...)


@dataclass(frozen=True, kw_only=True)
class LeaseRelease:
    """The agent gives a lease back unfinished (Ctrl-C); its samples are requeued."""

    kind: Literal["release"] = "release"
    lease_id: int


@dataclass(frozen=True, kw_only=True)
class ReleaseAck:
    kind: Literal["release_ack"] = "release_ack"
    lease_id: int


@dataclass(frozen=True, kw_only=True)
class VersionPublished:
    """Pushed to agents when every slice of a new parameter version is ready."""

    kind: Literal["version"] = "version"
    campaign_id: int
    version: int
    loss: float | None = None  # mean training loss of the step that made it


@dataclass(frozen=True, kw_only=True)
class ErrorMessage:
    """A rejected message; the connection stays open unless a close follows."""

    kind: Literal["error"] = "error"
    code: str  # short, lower-case: "malformed json", "unknown message", ...
    detail: str


# ------------------------------------------------ backbone: aggregator <-> site


@dataclass(frozen=True, kw_only=True)
class BackboneHello:
    kind: Literal["backbone_hello"] = "backbone_hello"
    protocol_version: int = PROTOCOL_VERSION
    name: str  # stable across restarts, so the site gives it back its slices
    upload_url: str
    params_url: str


@dataclass(frozen=True, kw_only=True)
class BackboneWelcome:
    kind: Literal["backbone_welcome"] = "backbone_welcome"
    aggregator_id: int
    ticket_key: str  # hex HMAC key for tickets and receipts
    heartbeat_s: float


@dataclass(frozen=True, kw_only=True)
class SliceAssignment:
    """Own elements ``start:end`` of a campaign's flat parameter vector."""

    kind: Literal["assign"] = "assign"
    campaign_id: int
    slice_index: int
    start: int
    end: int
    param_count: int
    model: ModelSpec
    optimizer: OptimizerSpec
    seed: int
    version: int  # the campaign's newest committed version; load its checkpoint if > 0
    staleness: int
    checkpoint_every: int
    max_grad_norm: float  # per-lease gradient norm bound per sample; 0 disables
    # Where to go when this slice has no checkpoint of ``version``: the newest version every slice has
    # a confirmed checkpoint of (0: the seeded init), or None when the campaign has stepped and there is
    # none; then the slice reports itself lost rather than start the campaign over.
    restore_version: int | None = None


@dataclass(frozen=True, kw_only=True)
class SliceReady:
    kind: Literal["slice_ready"] = "slice_ready"
    campaign_id: int
    slice_index: int
    version: int  # the version this slice holds now


@dataclass(frozen=True, kw_only=True)
class SliceLost:
    """This slice has no usable state for the versions the site offered; the campaign waits for an operator."""

    kind: Literal["slice_lost"] = "slice_lost"
    campaign_id: int
    slice_index: int
    version: int  # the version it was asked for
    detail: str


@dataclass(frozen=True, kw_only=True)
class CheckpointSaved:
    """The checkpoint of ``version`` of this slice is written and can be restored from."""

    kind: Literal["checkpoint_saved"] = "checkpoint_saved"
    campaign_id: int
    slice_index: int
    version: int


@dataclass(frozen=True, kw_only=True)
class CheckpointComplete:
    """Every slice of the campaign has a checkpoint of these versions (newest last): keep them when pruning."""

    kind: Literal["checkpoint_complete"] = "checkpoint_complete"
    campaign_id: int
    versions: list[int]


@dataclass(frozen=True, kw_only=True)
class SliceUnassign:
    kind: Literal["unassign"] = "unassign"
    campaign_id: int


@dataclass(frozen=True, kw_only=True)
class StepCommit:
    """Step ``step`` is exactly these leases; apply it to make version ``step + 1``."""

    kind: Literal["commit"] = "commit"
    campaign_id: int
    step: int
    lease_ids: list[int]
    num_samples: int


@dataclass(frozen=True, kw_only=True)
class StepApplied:
    kind: Literal["applied"] = "applied"
    campaign_id: int
    slice_index: int
    step: int
    version: int


@dataclass(frozen=True, kw_only=True)
class StepFailed:
    kind: Literal["step_failed"] = "step_failed"
    campaign_id: int
    slice_index: int
    step: int
    missing_lease_ids: list[int] = field(default_factory=list)
    detail: str


@dataclass(frozen=True, kw_only=True)
class Rollback:
    """Load the coordinated checkpoint of ``version`` and drop everything newer."""

    kind: Literal["rollback"] = "rollback"
    campaign_id: int
    version: int


# ------------------------------------------------------- data: agent -> aggregator


@dataclass(frozen=True, kw_only=True)
class UploadBegin:
    """Announces one slice of one lease's gradient; ``num_chunks`` binary frames follow."""

    kind: Literal["upload"] = "upload"
    ticket: str
    slice_index: int
    codec: CodecName
    num_elements: int
    num_chunks: int


@dataclass(frozen=True, kw_only=True)
class UploadReceipt:
    kind: Literal["receipt"] = "receipt"
    lease_id: int
    slice_index: int
    token: str


@dataclass(frozen=True, kw_only=True)
class UploadRejected:
    kind: Literal["upload_rejected"] = "upload_rejected"
    lease_id: int | None
    slice_index: int | None
    code: str  # "bad ticket", "replayed upload", "stale version", "not finite", ...
    detail: str


Message = Union[
    AgentHello, Welcome, Heartbeat, LeaseRequest, Lease, NoLease, LeaseDone, DoneAck,
    LeaseRelease, ReleaseAck, VersionPublished, ErrorMessage,
    BackboneHello, BackboneWelcome, SliceAssignment, SliceReady, SliceLost, CheckpointSaved, CheckpointComplete,
    SliceUnassign, StepCommit, StepApplied, StepFailed, Rollback,
    UploadBegin, UploadReceipt, UploadRejected,
]  # fmt: skip

MESSAGE_TYPES: dict[str, type] = {
    cls.__dataclass_fields__["kind"].default: cls  # type: ignore[attr-defined]
    for cls in Message.__args__  # type: ignore[attr-defined]
}

AGENT_TO_SITE = (AgentHello, Heartbeat, LeaseRequest, LeaseDone, LeaseRelease)
BACKBONE_TO_SITE = (BackboneHello, Heartbeat, SliceReady, SliceLost, CheckpointSaved, StepApplied, StepFailed)
AGENT_TO_AGGREGATOR = (UploadBegin,)


def encode_message(message: Any) -> str:
    """Serialize a message dataclass to its JSON text frame."""
    return json.dumps(to_dict(message), separators=(",", ":"), allow_nan=False)


def decode_message(text: str | bytes, allowed: Iterable[type[M]] | None = None) -> M:
    """Parse and validate one JSON text frame.

    Args:
        text: the frame as received.
        allowed: the message classes this receiver accepts; None accepts any.

    Returns:
        The message dataclass, every field checked.

    Raises:
        ProtocolError: malformed JSON, a frame over the size limit, an unknown
            or unexpected ``kind``, or a field of the wrong type.
    """
    if len(text) > MAX_CONTROL_MESSAGE_BYTES:
        raise ProtocolError(
            f"control message of {len(text)} bytes is over the {MAX_CONTROL_MESSAGE_BYTES} byte limit",
            close_code=CloseCode.TOO_LARGE,
        )
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed json: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"expected a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if allowed is not None and cls not in tuple(allowed):
        raise ProtocolError(f"message kind {kind!r} is not accepted on this channel")
    return from_dict(cls, data)  # type: ignore[return-value]

__all__ = [
    "AGENT_TO_AGGREGATOR", "AGENT_TO_SITE", "BACKBONE_TO_SITE", "MESSAGE_TYPES", "CodecName", "DataSpec",
    "DeviceInfo", "Message", "ModelSpec", "NoLeaseReason", "OptimizerSpec", "Receipt", "SampleRange",
    "SliceRoute", "decode_message", "encode_message",
    *(cls.__name__ for cls in MESSAGE_TYPES.values()),
]  # fmt: skip
