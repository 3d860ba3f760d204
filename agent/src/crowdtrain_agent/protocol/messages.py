"""Every JSON message of the Crowdtrain protocol, shared by agent, site and aggregator.

Three channels carry them (see agent/PROTOCOL.md):

- control, agent <-> site, ``/ws/agent/``: hello, heartbeats, leases, done reports;
- backbone, aggregator <-> site, ``/ws/backbone/``: slice assignments, step commits;
- data, agent -> aggregator: an ``upload`` header followed by binary chunks.

Each message is a frozen msgspec Struct whose ``kind`` is its wire tag; the
field types carry the bounds (``schema``). Which side may send which message
is declared once, in ``directions``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, cast

import msgspec

from .errors import ProtocolError
from .frames import MAX_CONTROL_MESSAGE_BYTES, PROTOCOL_MINOR, CloseCode
from .schema import (
    Bytes,
    ConfigValue,
    Count,
    Id,
    Message,
    Name,
    Part,
    Rate,
    Real,
    Seconds,
    SliceIndex,
    Text,
    Token,
    Url,
    Version,
    explain,
    newest_field,
    strip_unknown,
    to_wire,
)

M = TypeVar("M", bound=Message)

# "sync": a lease's upload is its summed gradient; "local" (2.3): a pseudo-gradient of inner steps (see Lease).
TrainingMode = Literal["sync", "local"]
CodecName = Literal["fp32", "fp16", "int8"]  # "int8" since 2.3: an older peer cannot read it (``since_values``)
# Elements per scale of the int8 codec (crowdtrain_agent.codec.MIN_INT8_BLOCK_SIZE to MAX_INT8_BLOCK_SIZE).
BlockSize = Annotated[int, msgspec.Meta(ge=32, le=1 << 16)]
DeviceKind = Literal["cpu", "cuda", "mps", "browser"]  # "browser" since 2.10 (``DeviceInfo.since_values``)
DataKind = Literal["text", "tensors", "tokens"]  # "tokens" since 2.6
TokenBytes = Literal[0, 2, 4]  # bytes per token id of a token shard; 0 for other kinds
Augment = Literal["none", "flip", "flip_crop"]  # what agents do to image samples (DataSpec)
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
HexKey = Annotated[str, msgspec.Meta(pattern="^(?:[0-9a-f]{64})?$")]  # a 32-byte HMAC key in hex, or "" for none
RequestId = Annotated[str, msgspec.Meta(max_length=64)]

# ---------------------------------------------------------------- shared parts


class DeviceInfo(Part, frozen=True, kw_only=True):
    """Hardware an agent reports; shown on the volunteer's device page.

    ``kind`` "browser" (2.10) is a browser tab computing with onnxruntime-web:
    a 2.9 site's decoder refuses it, so a tab that was answered with 2.9 must
    not say hello as one. ``runtime`` (2.10, advisory: only shown) says what
    computes, as ``torch_version`` does for an agent ("onnxruntime-web 1.30.0
    wasm" or "... webgpu").
    """

    since: ClassVar[dict[str, int]] = {"runtime": 10}
    advisory: ClassVar[frozenset[str]] = frozenset({"runtime"})
    since_values: ClassVar[dict[str, dict[str, int]]] = {"kind": {"browser": 10}}

    kind: DeviceKind
    name: Name
    memory_bytes: Bytes = 0
    threads: Count = 1
    torch_version: Name = ""
    flops_per_s: Rate = 0.0  # measured by a short matmul benchmark at start-up
    runtime: Name = ""


class ModelSpec(Part, frozen=True, kw_only=True):
    """An architecture from the agent's model registry and its keyword arguments."""

    architecture: Name
    config: dict[Name, ConfigValue]


class DataSpec(Part, frozen=True, kw_only=True):
    """How to turn a shard's bytes into samples.

    ``text``: raw bytes, ``sample_len`` bytes per sample (inputs are the first
    ``sample_len - 1``, targets the last ``sample_len - 1``).
    ``tensors``: a safetensors file with arrays ``x`` and ``y``, one row per sample.
    ``tokens`` (2.6): little-endian unsigned token ids of ``token_bytes`` each,
    ``sample_len`` ids per sample, every id below ``vocab_size``; ``tokenizer``
    is the sha256 of the ``tokenizer.json`` that made them, fetched like a shard.
    None of this is advisory: a 2.5 agent would read ids as bytes.
    ``augment`` (2.6, image samples of 0..255 pixels): random flips, or flips
    and shifted crops, seeded by the sample and the lease's base version, so
    two devices computing one lease see the same images. Not advisory either.
    """

    since: ClassVar[dict[str, int]] = {"token_bytes": 6, "vocab_size": 6, "tokenizer": 6, "augment": 6}
    since_values: ClassVar[dict[str, dict[str, int]]] = {"kind": {"tokens": 6}}

    kind: DataKind
    sample_len: Count = 0
    token_bytes: TokenBytes = 0
    vocab_size: Count = 0
    tokenizer: HexKey = ""  # sha256 hex of the tokenizer.json, or "" for none
    augment: Augment = "none"


class SampleRange(Part, frozen=True, kw_only=True):
    """``count`` consecutive samples of one shard, starting at sample ``start``."""

    shard: Sha256  # sha256 hex of the shard's bytes
    start: Count
    count: Count


class SliceRoute(Part, frozen=True, kw_only=True):
    """Where slice ``index`` (elements ``start:end`` of the flat parameter vector) lives."""

    index: Count
    start: Count
    end: Count
    upload_url: Url  # ws:// URL of the aggregator's data channel
    params_url: Url  # http:// URL prefix; GET {params_url}{version} returns the slice


class OptimizerSpec(Part, frozen=True, kw_only=True):
    """The optimizer the aggregators apply to their slices, and its learning-rate schedule.

    AdamW and SGD are elementwise, so slices compose to the full model. LAMB
    scales each parameter tensor's update by a trust ratio of norms, so a
    LAMB campaign's slices are cut at tensor boundaries. ``beta1``, ``beta2``
    and ``eps`` serve AdamW and LAMB; ``momentum`` serves SGD.

    The learning rate of step ``s`` is ``lr * lr_multiplier(s)``: a linear
    warmup over ``warmup_steps``, then constant, or a cosine decay that
    reaches ``lr * min_lr_ratio`` at ``total_steps`` and stays there.
    """

    # A key of crowdtrain_agent.optimizers.OPTIMIZERS: the site and the aggregator both check it there.
    name: Name = "adamw"
    lr: Real = 1e-3
    beta1: Real = 0.9
    beta2: Real = 0.999
    eps: Real = 1e-8
    weight_decay: Real = 0.0
    momentum: Real = 0.0
    warmup_steps: Count = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: Real = 0.0
    total_steps: Version | None = None  # the site fills it from the campaign's max_steps
    decay_all: bool = False  # weight decay on every tensor (default: tensors of 2 or more dimensions only)
    # Hyperparameters of registered optimizers that have no field of their own, by registry name.
    extra: dict[Name, Real] = {}
    # 2.3: Nesterov momentum for SGD (DiLoCo's outer optimizer). Not advisory: without it the step differs.
    nesterov: bool = False

    since: ClassVar[dict[str, int]] = {"decay_all": 1, "extra": 1, "nesterov": 3}

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


class Receipt(Part, frozen=True, kw_only=True):
    """An aggregator's signed proof that it holds one slice of a lease's gradient."""

    slice_index: SliceIndex
    token: Token


# ------------------------------------------------------ control: agent <-> site


class AgentHello(Message, tag="hello", frozen=True, kw_only=True):
    protocol_version: Version  # the major version; the minor is negotiated as the WebSocket subprotocol
    agent_version: Name
    device: DeviceInfo


class DeviceControls(Part, frozen=True, kw_only=True):
    """The volunteer's controls for one device, set on My devices (2.8); what the agent is given locally (flags,
    variables, its controls file) comes first. None or "": not set. The agent checks them as it checks its own."""

    idle_minutes: Annotated[float, msgspec.Meta(ge=0, le=1440)] | None = None
    max_other_cpu_percent: Annotated[float, msgspec.Meta(ge=1, le=100)] | None = None
    schedule: Name = ""  # "mon-fri 18:00-08:00; sat,sun 00:00-24:00" (``controls.parse_schedule``)
    pause_on_battery: bool = False
    upload_kbps: Annotated[float, msgspec.Meta(ge=8, le=1e8)] | None = None
    download_kbps: Annotated[float, msgspec.Meta(ge=8, le=1e8)] | None = None
    threads: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None  # 2.9: CPU threads PyTorch may use
    gpu_memory_gb: Annotated[float, msgspec.Meta(ge=0.1, le=4096)] | None = None  # 2.9: of the GPU it computes on

    since: ClassVar[dict[str, int]] = {"threads": 9, "gpu_memory_gb": 9}
    advisory: ClassVar[frozenset[str]] = frozenset({"threads", "gpu_memory_gb"})


class Welcome(Message, tag="welcome", frozen=True, kw_only=True):
    device_id: Id
    device_name: Name
    volunteer: Name
    heartbeat_s: Seconds
    gone_after_s: Seconds
    controls: DeviceControls | None = None  # 2.8: set on My devices; an older agent has its own flags only

    since: ClassVar[dict[str, int]] = {"controls": 8}
    advisory: ClassVar[frozenset[str]] = frozenset({"controls"})


class ControlsChanged(Message, tag="controls", frozen=True, kw_only=True):
    """Site to agent (2.9): the volunteer changed the device's controls on My devices while its agent was
    connected; the agent takes them as it takes the welcome's (its own flags, variables and file still win).
    None: every control was cleared."""

    controls: DeviceControls | None = None


class Heartbeat(Message, tag="heartbeat", frozen=True, kw_only=True):
    """Sent every HEARTBEAT_INTERVAL_S by agents and aggregators; no reply."""


class Paused(Message, tag="paused", frozen=True, kw_only=True):
    """Agent to site (2.8): the volunteer's controls stopped work (``why``, in words: "outside your schedule"),
    or, with ``why`` empty, allow it again. Shown on My devices; nothing else changes at the site."""

    why: Name = ""


class LeaseRequest(Message, tag="lease_request", frozen=True, kw_only=True):
    campaign_id: Id | None = None  # None: any running campaign
    samples_per_s: Rate | None = None  # measured on that campaign's model; None until known
    request_id: RequestId = ""  # the same for a resent request, so the site answers with the same lease (max 64)
    # How long the site may hold the request when every step this device may work on is full: it
    # answers the moment a commit makes room, instead of the agent asking again and again. 0: at once.
    wait_s: Seconds = 0.0


class Lease(Message, tag="lease", frozen=True, kw_only=True):
    """One assignment of sample ranges to one agent, with a deadline."""

    lease_id: Id
    campaign_id: Id
    # Parameter version to compute the gradient against: the newest committed step's, which the
    # aggregators may still be applying (their parameter downloads wait for it a few seconds).
    base_version: Version
    ranges: list[SampleRange]
    num_samples: Count
    microbatch_size: Count
    deadline_s: Seconds  # seconds from now; relative so clock skew does not matter
    ticket: Token
    codec: CodecName
    model: ModelSpec
    data: DataSpec
    param_count: Count
    slices: list[SliceRoute]
    # Shards the campaign's next leases will read (sha256): fetched ahead, while this lease computes,
    # so a lease seldom waits for its data. Agents take the first few.
    prefetch: list[Annotated[str, msgspec.Meta(max_length=64)]] = []
    # 2.3: elements per scale when ``codec`` is int8. Advisory: it means nothing for another codec,
    # and a lease in int8 (which ``since_values`` marks 2.3) is never sent to an older agent.
    codec_block_size: BlockSize = 256
    # 2.3: "local" (DiLoCo): train a copy of the model with ``inner`` over the lease's samples, one inner
    # step per ``inner_batch_size`` samples (gradients of its microbatches added up), and upload the
    # pseudo-gradient (base minus final parameters) times ``num_samples`` instead of the summed gradient.
    # An older agent would upload a gradient: such a lease is never sent to it.
    mode: TrainingMode = "sync"
    inner: OptimizerSpec | None = None  # the inner optimizer of a "local" lease; its lr is already scheduled
    # Samples per inner step, a multiple of ``microbatch_size``; None: one microbatch. The lease's last
    # inner step takes what is left when ``num_samples`` is not a multiple.
    inner_batch_size: Count | None = None
    # 2.4, local leases only: the version this lease's round steps from, when it is newer than
    # ``base_version``. The site leases the next round while the last one is still being uploaded and
    # published (staleness 1): the agent starts from its own estimate of that version, moves its
    # parameters onto the exact one when it is published, and uploads its movement from there.
    # Not advisory: an older agent would upload a movement from ``base_version`` instead.
    rebase_to: Version | None = None
    # 2.6: a CUDA device may compute in bf16 autocast (fp16 with a loss scale where bf16 is missing); the
    # gradient is uploaded in fp32 either way (``crowdtrain_agent.precision``). Advisory: an older agent
    # computes in fp32, the same gradient within verification's tolerance.
    mixed_precision: bool = False

    since: ClassVar[dict[str, int]] = {
        "codec_block_size": 3, "mode": 3, "inner": 3, "inner_batch_size": 3, "rebase_to": 4, "mixed_precision": 6,
    }  # fmt: skip
    advisory: ClassVar[frozenset[str]] = frozenset({"codec_block_size", "mixed_precision"})
    since_values: ClassVar[dict[str, dict[str, int]]] = {"codec": {"int8": 3}}

    @property
    def round_base(self) -> int:
        """The version the lease's pseudo-gradient must be a movement from: the base of the step it counts in."""
        return self.base_version if self.rebase_to is None else self.rebase_to


NoLeaseReason = Literal[
    "no_campaign",  # nothing is running that this device may join
    "campaign_paused",  # the campaign exists but is paused or waits for aggregators
    "step_full",  # the open step has all the samples it needs; wait for its commit
    "epoch_done",  # every sample of the epoch is leased; wait for stragglers
    "campaign_finished",
    # 2.2: the volunteer is quarantined (results that disagreed with other volunteers'); the detail says
    # why and where to appeal. An older agent hears "no_campaign" with the same detail.
    "quarantined",
]


class NoLease(Message, tag="no_lease", frozen=True, kw_only=True):
    """Why no lease was given, and when to ask again."""

    reason: NoLeaseReason
    detail: Text
    retry_after_s: Seconds
    # For "step_full": asking again can succeed once the campaign has committed this many steps.
    ready_at_step: Version | None = None


def no_lease_why(reason: str, detail: str) -> str:
    """Why no lease was given, as a person reads it: ``"step full: step 3 is full"``.

    The agent's status line and the site's My devices page both say this, so
    a volunteer reads the same words on the terminal and in the browser.

    Args:
        reason: a ``NoLease.reason`` (a ``NoLeaseReason``; an unknown one reads as it is).
        detail: the refusal's ``detail``; may be empty.

    Returns:
        The reason with spaces for underscores, then ": " and the detail when there is one.
    """
    words = reason.replace("_", " ")
    return f"{words}: {detail}" if detail else words


def no_lease_status(reason: str, detail: str) -> str:
    """The agent's status line while it waits after a refusal: ``"waiting for work (step full: ...)"``.

    Args:
        reason: a ``NoLease.reason``.
        detail: the refusal's ``detail``; may be empty.

    Returns:
        The text the agent shows and My devices repeats.
    """
    return f"waiting for work ({no_lease_why(reason, detail)})"


class LeaseDone(Message, tag="done", frozen=True, kw_only=True):
    lease_id: Id
    receipts: list[Receipt]
    num_samples: Count
    loss_sum: Real  # sum over samples of each sample's mean token loss
    compute_s: Seconds
    # 2.3, advisory: what the lease cost the agent's link. Bytes it uploaded for this lease and downloaded
    # (its share of parameter and shard downloads), and the seconds it waited on the network meanwhile.
    bytes_up: Bytes = 0
    bytes_down: Bytes = 0
    network_s: Seconds = 0.0

    since: ClassVar[dict[str, int]] = {"bytes_up": 3, "bytes_down": 3, "network_s": 3}
    advisory: ClassVar[frozenset[str]] = frozenset({"bytes_up", "bytes_down", "network_s"})


class DoneAck(Message, tag="done_ack", frozen=True, kw_only=True):
    lease_id: Id
    accepted: bool
    step: Version | None = None  # the step the samples count in, when accepted
    reason: Text = ""  # why not, when rejected ("lease expired", "stale version", ...)
    # "pending": the lease was picked for verification, its credit waits for another volunteer's copy;
    # "check": the lease was itself such a copy, compared with another volunteer's result, never in a step.
    verification: Literal["", "pending", "check"] = ""

    since: ClassVar[dict[str, int]] = {"verification": 2}
    advisory: ClassVar[frozenset[str]] = frozenset({"verification"})


class LeaseRelease(Message, tag="release", frozen=True, kw_only=True):
    """The agent gives a lease back unfinished (Ctrl-C); its samples are requeued."""

    lease_id: Id


class ReleaseAck(Message, tag="release_ack", frozen=True, kw_only=True):
    lease_id: Id


class VersionPublished(Message, tag="version", frozen=True, kw_only=True):
    """Pushed to agents when every slice of a new parameter version is ready."""

    campaign_id: Id
    version: Version
    loss: Real | None = None  # mean training loss of the step that made it


class ErrorMessage(Message, tag="error", frozen=True, kw_only=True):
    """A rejected message; the connection stays open unless a close follows."""

    code: Name  # short, lower-case: "malformed json", "unknown message", ...
    detail: Text


# ------------------------------------------------ backbone: aggregator <-> site


class BackboneHello(Message, tag="backbone_hello", frozen=True, kw_only=True):
    protocol_version: Version  # the major version; the minor is negotiated as the WebSocket subprotocol
    name: Name  # stable across restarts, so the site gives it back its slices
    upload_url: Url
    params_url: Url


class BackboneWelcome(Message, tag="backbone_welcome", frozen=True, kw_only=True):
    aggregator_id: Id
    # Hex HMAC key for tickets and receipts of every campaign, for a 2.0 aggregator; "" to 2.1 ones,
    # which get each campaign's key with its slices (assign.ticket_key).
    ticket_key: Token
    heartbeat_s: Seconds


class SliceAssignment(Message, tag="assign", frozen=True, kw_only=True):
    """Own elements ``start:end`` of a campaign's flat parameter vector."""

    campaign_id: Id
    slice_index: SliceIndex
    start: Count
    end: Count
    param_count: Count
    model: ModelSpec
    optimizer: OptimizerSpec
    seed: Id
    version: Version  # the campaign's newest committed version; load its checkpoint if > 0
    staleness: Count
    checkpoint_every: Count
    max_grad_norm: Real  # per-lease gradient norm bound per sample; 0 disables
    # Where to go when this slice has no checkpoint of ``version``: the newest version every slice has
    # a confirmed checkpoint of (0: the seeded init), or None when the campaign has stepped and there is
    # none; then the slice reports itself lost rather than start the campaign over.
    restore_version: Version | None = None
    # The codec the campaign's agents upload with; the aggregator refuses any other (None: any, as
    # a 2.0 site does not say).
    codec: CodecName | None = None
    # The campaign's own key for tickets and receipts, hex (tickets.campaign_key); "" from a 2.0 site,
    # which signs every campaign with the welcome's key. Not advisory: a 2.0 aggregator would check
    # this campaign's tickets with the wrong key, so the site tells it to upgrade instead.
    ticket_key: HexKey = ""
    # How the step's contributions combine (crowdtrain_backbone.robust): the plain mean, or a robust mean
    # that counts each lease as one vote. Not advisory: a 2.1 aggregator would take the plain mean.
    aggregation: Literal["mean", "trimmed_mean", "centered_clip"] = "mean"
    # Each contribution's norm per sample is clipped to this many times the median of the slice's recent
    # ones; 0 disables. Advisory: a 2.1 aggregator only loses a defence, the step means the same.
    clip_factor: Real = 10.0
    # The share of the largest and of the smallest values dropped per coordinate by ``trimmed_mean``.
    # Advisory: it means nothing unless ``aggregation`` (which is not) says trimmed_mean.
    trim_fraction: Real = 0.1
    # 2.3: elements per scale of the int8 codec. Advisory for the same reason as the lease's: an int8
    # campaign (``since_values``) is never assigned to an older aggregator, and other codecs have no blocks.
    codec_block_size: BlockSize = 256
    # 2.5: the campaign's rollbacks so far (see ``StepCommit.timeline``). Advisory: a 2.4 aggregator only
    # loses the fence against a commit that a rollback overtook.
    timeline: Count = 0
    # 2.6: the sha256 of the pretrained weights version 0 is (flat fp32, little-endian; the aggregator
    # fetches them from the site's /api/backbone/weights/<sha256> and checks every byte), or "" for the
    # seeded init. Not advisory: a 2.5 aggregator would start the campaign from random weights.
    initial: HexKey = ""

    since: ClassVar[dict[str, int]] = {
        "codec": 1,
        "ticket_key": 1,
        "aggregation": 2,
        "clip_factor": 2,
        "trim_fraction": 2,
        "codec_block_size": 3,
        "timeline": 5,
        "initial": 6,
    }
    advisory: ClassVar[frozenset[str]] = frozenset(
        {"codec", "clip_factor", "trim_fraction", "codec_block_size", "timeline"}
    )
    since_values: ClassVar[dict[str, dict[str, int]]] = {"codec": {"int8": 3}}


def retained_versions(staleness: int) -> int:
    """How many published versions an aggregator keeps: the staleness window, plus the one in flight.

    Agents may train on any version of the window, and the site leases on the
    newest committed version while the aggregators may still be applying it;
    the site's verification copies (``oldest_copyable``) count on the same number.
    """
    return staleness + 2


def trim_count(contributions: int, trim_fraction: float) -> int:
    """Values a trimmed mean drops at each end of a coordinate: ``floor(trim_fraction * n)``, leaving at least one.

    Shared by the aggregators, which trim, and the site, which keeps a volunteer on
    probation to no more leases of a step than this (``verification.standing``).
    """
    fraction = min(max(trim_fraction, 0.0), 0.5)
    # The epsilon keeps 0.3 * 10 (2.9999999999999996 in floats) at 3.
    return max(0, min(math.floor(fraction * contributions + 1e-9), (contributions - 1) // 2))


class SliceReady(Message, tag="slice_ready", frozen=True, kw_only=True):
    campaign_id: Id
    slice_index: SliceIndex
    version: Version  # the version this slice holds now


class SliceLost(Message, tag="slice_lost", frozen=True, kw_only=True):
    """This slice has no usable state for the versions the site offered; the campaign waits for an operator."""

    campaign_id: Id
    slice_index: SliceIndex
    version: Version  # the version it was asked for
    detail: Text


class UploadRefused(Message, tag="upload_refused", frozen=True, kw_only=True):
    """An aggregator refused an upload of this lease for what it held (``REFUSALS_THAT_COUNT``), not how it came.

    Since 2.7; sent only to a site that speaks it. The site counts it against
    the lease's volunteer: a gradient of NaNs is refused, never checked, so
    without this its sender was never quarantined.
    """

    campaign_id: Id
    lease_id: Id
    slice_index: SliceIndex
    code: Name
    detail: Text


class CheckpointSaved(Message, tag="checkpoint_saved", frozen=True, kw_only=True):
    """The checkpoint of ``version`` of this slice is written and can be restored from."""

    campaign_id: Id
    slice_index: SliceIndex
    version: Version


class CheckpointComplete(Message, tag="checkpoint_complete", frozen=True, kw_only=True):
    """Every slice of the campaign has a checkpoint of these versions (newest last): keep them when pruning."""

    campaign_id: Id
    versions: list[Version]


class SliceUnassign(Message, tag="unassign", frozen=True, kw_only=True):
    campaign_id: Id


class StepCommit(Message, tag="commit", frozen=True, kw_only=True):
    """Step ``step`` is exactly these leases; apply it to make version ``step + 1``."""

    campaign_id: Id
    step: Version
    lease_ids: list[Id]
    num_samples: Count
    # 2.5: how many rollbacks the campaign had when the step was written. A commit of an older timeline
    # than the last ``rollback`` or ``assign`` the aggregator heard is one the rollback undid, delivered
    # late: it is dropped, never applied (its step index may be taken again by the redone steps).
    timeline: Count = 0

    since: ClassVar[dict[str, int]] = {"timeline": 5}
    advisory: ClassVar[frozenset[str]] = frozenset({"timeline"})


class StepApplied(Message, tag="applied", frozen=True, kw_only=True):
    campaign_id: Id
    slice_index: SliceIndex
    step: Version
    version: Version


class StepFailed(Message, tag="step_failed", frozen=True, kw_only=True):
    campaign_id: Id
    slice_index: SliceIndex
    step: Version
    missing_lease_ids: list[Id] = []
    detail: Text


class Rollback(Message, tag="rollback", frozen=True, kw_only=True):
    """Load the coordinated checkpoint of ``version`` and drop everything newer."""

    campaign_id: Id
    version: Version
    timeline: Count = 0  # 2.5: the campaign's rollbacks, this one included (``StepCommit.timeline``)

    since: ClassVar[dict[str, int]] = {"timeline": 5}
    advisory: ClassVar[frozenset[str]] = frozenset({"timeline"})


# ------------------------------------------------------- data: agent -> aggregator


class UploadBegin(Message, tag="upload", frozen=True, kw_only=True):
    """Announces one slice of one lease's gradient; ``num_chunks`` binary frames follow."""

    ticket: Token
    slice_index: SliceIndex
    codec: CodecName
    num_elements: Count
    num_chunks: Count
    # 2.3: the lease's ``codec_block_size``, so an aggregator refuses a payload cut into other blocks by
    # name instead of decoding it wrong.
    codec_block_size: BlockSize = 256

    since: ClassVar[dict[str, int]] = {"codec_block_size": 3}
    advisory: ClassVar[frozenset[str]] = frozenset({"codec_block_size"})


class UploadReceipt(Message, tag="receipt", frozen=True, kw_only=True):
    lease_id: Id
    slice_index: SliceIndex
    token: Token


class UploadRejected(Message, tag="upload_rejected", frozen=True, kw_only=True):
    lease_id: Id | None
    slice_index: SliceIndex | None
    code: Name  # "bad ticket", "replayed upload", "stale version", "not finite", ...
    detail: Text


ALL_MESSAGES: tuple[type[Message], ...] = (
    AgentHello,
    Welcome,
    Heartbeat,
    LeaseRequest,
    Lease,
    NoLease,
    LeaseDone,
    DoneAck,
    LeaseRelease,
    ReleaseAck,
    VersionPublished,
    ErrorMessage,
    BackboneHello,
    BackboneWelcome,
    SliceAssignment,
    SliceReady,
    SliceLost,
    CheckpointSaved,
    CheckpointComplete,
    SliceUnassign,
    StepCommit,
    StepApplied,
    StepFailed,
    Rollback,
    UploadBegin,
    UploadReceipt,
    UploadRejected,
    UploadRefused,
    Paused,
    ControlsChanged,
)

MESSAGE_TYPES: dict[str, type[Message]] = {str(cls.__struct_config__.tag): cls for cls in ALL_MESSAGES}

# Which side sends what, once for every receiver: a message of any other kind is refused.
AGENT_TO_SITE = (AgentHello, Heartbeat, LeaseRequest, LeaseDone, LeaseRelease, Paused)
# The first minor whose site takes ``paused``.
PAUSED_SINCE = 8
SITE_TO_AGENT = (Welcome, Lease, NoLease, DoneAck, ReleaseAck, VersionPublished, ErrorMessage, ControlsChanged)
# The first minor whose agent takes ``controls``: an older one keeps the welcome's until it reconnects.
CONTROLS_PUSHED_SINCE = 9
BACKBONE_TO_SITE = (
    BackboneHello,
    Heartbeat,
    SliceReady,
    SliceLost,
    CheckpointSaved,
    StepApplied,
    StepFailed,
    UploadRefused,
)
# The first minor whose site takes ``upload_refused``: an older one would answer an unknown kind with errors.
UPLOAD_REFUSED_SINCE = 7
# Refusals of an upload's content, which an honest agent never sends (it checks its gradient is finite
# first): they count against its volunteer. Not how it came (a replay, a stale version, a cut connection:
# an honest agent's retry or bad luck), nor the norm bound, which the organizer may set too tight.
REFUSALS_THAT_COUNT = frozenset({"not finite", "bad payload", "wrong chunk count", "wrong chunk size"})
SITE_TO_BACKBONE = (
    BackboneWelcome,
    Heartbeat,
    SliceAssignment,
    StepCommit,
    Rollback,
    SliceUnassign,
    CheckpointComplete,
    ErrorMessage,
)
AGENT_TO_AGGREGATOR = (UploadBegin,)
AGGREGATOR_TO_AGENT = (UploadReceipt, UploadRejected, ErrorMessage)


def encode_message(message: Message, minor: int = PROTOCOL_MINOR) -> str:
    """Serialize a message to its JSON text frame, for a peer that speaks protocol minor ``minor``.

    Fields a later minor added are left out for an older peer: its decoder
    may be strict (2.0 refused unknown fields), and it could not use them.
    """
    if newest_field(type(message)) <= minor:
        return _ENCODER.encode(message).decode()
    return _ENCODER.encode(to_wire(message, minor)).decode()


_ENCODER = msgspec.json.Encoder()


@cache
def _decoder(allowed: tuple[type[Message], ...]) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(Union[allowed])  # noqa: UP007


Unknown = Callable[[str, list[str]], None]


def decode_message(text: str | bytes, allowed: Iterable[type[M]] | None = None, *, unknown: Unknown | None = None) -> M:
    """Parse and validate one JSON text frame; total: any input gives a message or a ProtocolError.

    Args:
        text: the frame as received.
        allowed: the message classes this receiver accepts (one of the
            direction tuples above); None accepts any.
        unknown: called with the message kind and the field paths it ignored
            when the frame carries fields this version does not know (a newer
            minor sent them); receivers log that once per connection.

    Returns:
        The message, every field checked against its type and bounds.

    Raises:
        ProtocolError: malformed JSON (or nested deeper than any message), a
            frame over the size limit (fatal, close code 4008), an unknown or
            unexpected ``kind``, a missing field, or a value of the wrong type
            or out of bounds; the message names the field.
    """
    size = len(text)
    if size > MAX_CONTROL_MESSAGE_BYTES // 4 and isinstance(text, str):
        size = len(text.encode("utf-8", "surrogatepass"))  # the limit is in bytes, and a character is up to 4
    if size > MAX_CONTROL_MESSAGE_BYTES:
        raise ProtocolError(
            f"control message of {size} bytes is over the {MAX_CONTROL_MESSAGE_BYTES} byte limit",
            close_code=CloseCode.TOO_LARGE,
            fatal=True,
        )
    accepted: tuple[type[Message], ...] = ALL_MESSAGES if allowed is None else tuple(allowed)
    try:
        return cast(M, _decoder(accepted).decode(text))
    except msgspec.ValidationError as exc:
        return cast(M, _decode_slowly(text, accepted, unknown, exc))
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed json: {exc}") from None
    except RecursionError:
        raise ProtocolError("malformed json: nested deeper than any message") from None


def _decode_slowly(
    text: str | bytes, accepted: tuple[type[Message], ...], unknown: Unknown | None, exc: msgspec.ValidationError
) -> Message:
    """The fast decoder refused the frame: say exactly why, or accept it without the fields it does not know."""
    try:
        data = msgspec.json.decode(text)
    except msgspec.DecodeError as error:
        raise ProtocolError(f"malformed json: {error}") from None
    except RecursionError:  # the typed decoder stopped early; a plain parse goes all the way down, too deep
        if "unknown field" in str(exc):
            raise ProtocolError("malformed json: nested deeper than any message") from None
        raise explain(exc, "message") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"expected a JSON object, got {_json_type(data)}")
    kind = data.get("kind")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {str(kind)[:40]!r}")
    if cls not in accepted:
        raise ProtocolError(f"message kind {kind!r} is not accepted on this channel")
    ignored = strip_unknown(cls, data)
    try:
        message = msgspec.convert(data, cls)
    except msgspec.ValidationError as error:
        raise explain(error, cls.__name__, cls) from None
    if ignored and unknown is not None:
        unknown(str(kind), ignored)
    return message


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


# Written out, so type checkers see the names; a test checks that every message class is here.
__all__ = [
    "AGENT_TO_AGGREGATOR",
    "AGENT_TO_SITE",
    "AGGREGATOR_TO_AGENT",
    "ALL_MESSAGES",
    "BACKBONE_TO_SITE",
    "MESSAGE_TYPES",
    "REFUSALS_THAT_COUNT",
    "UPLOAD_REFUSED_SINCE",
    "PAUSED_SINCE",
    "CONTROLS_PUSHED_SINCE",
    "ControlsChanged",
    "DeviceControls",
    "Paused",
    "SITE_TO_AGENT",
    "SITE_TO_BACKBONE",
    "BlockSize",
    "CodecName",
    "TrainingMode",
    "retained_versions",
    "trim_count",
    "DataKind",
    "DataSpec",
    "DeviceInfo",
    "Message",
    "ModelSpec",
    "NoLeaseReason",
    "OptimizerSpec",
    "Receipt",
    "SampleRange",
    "SliceRoute",
    "decode_message",
    "encode_message",
    "no_lease_status",
    "no_lease_why",
    "AgentHello",
    "BackboneHello",
    "BackboneWelcome",
    "CheckpointComplete",
    "CheckpointSaved",
    "DoneAck",
    "ErrorMessage",
    "Heartbeat",
    "Lease",
    "LeaseDone",
    "LeaseRelease",
    "LeaseRequest",
    "NoLease",
    "ReleaseAck",
    "Rollback",
    "SliceAssignment",
    "SliceLost",
    "SliceReady",
    "SliceUnassign",
    "StepApplied",
    "StepCommit",
    "StepFailed",
    "UploadBegin",
    "UploadReceipt",
    "UploadRejected",
    "UploadRefused",
    "VersionPublished",
    "Welcome",
]
