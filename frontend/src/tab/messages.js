// The control and data channels' JSON messages a browser tab sends and reads, checked as the agent checks them.
//
// One schema per message, transcribed from crowdtrain_agent.protocol.messages (protocol 2.10): the same
// fields, defaults and bounds, so a tab refuses what an agent refuses and never sends what a site
// would refuse. Unknown fields are ignored and reported (`onUnknown`), never refused: they come from
// a site of a newer minor. Errors name the field as the agent's do ("Lease.ranges[0].start: ...").
//
// Two differences a JavaScript reader cannot avoid, both harmless with a site of ours:
// - JSON.parse reads 3.0 as 3, so an integer written with a zero fraction is taken (msgspec refuses it;
//   the site never writes one);
// - ids are exact only up to 2**53 (Number.MAX_SAFE_INTEGER); a larger id, which the site never issues,
//   is refused rather than rounded to another lease's.
//
// The `hello` of a tab (protocol 2.10): device kind "browser" (`DeviceInfo.since_values = {"kind":
// {"browser": 10}}`: a 2.9 site refuses it, 4000 "device.kind"), described in the existing fields plus
// one advisory field of 2.10:
//   name          "<browser> <major> on <os> (tab)" from navigator.userAgentData (userAgent where missing),
//                 so My devices tells a tab from the agent on the same machine;
//   memory_bytes  navigator.deviceMemory GiB (a power of two the browser caps at 8) * 2**30, 0 where
//                 the browser does not say (Firefox, Safari);
//   threads       the wasm threads onnxruntime-web uses: 1 (two were slower than one on 2 cores);
//   torch_version "" (no torch in a tab);
//   flops_per_s   the training FLOP/s of the leases this browser computed (samples/s times the graph's
//                 FLOPs per sample), kept from its last visit; 0 on a first visit;
//   runtime       (2.10, <= 200 characters) "onnxruntime-web <version> wasm" or "... webgpu": what
//                 computes, where torch_version says it for an agent; left out for an older site.

export const PROTOCOL_VERSION = 2;
export const PROTOCOL_MINOR = 10;
export const MAX_CONTROL_MESSAGE_BYTES = 64 << 10;

/** A message the protocol refuses: malformed, out of bounds, or of a kind this channel does not carry. */
export class ProtocolError extends Error {
  constructor(message) {
    super(message);
    this.name = "ProtocolError";
  }
}

/** The WebSocket subprotocols a tab offers: its minor and the one before, as the agent does. */
export function offeredSubprotocols() {
  return [`crowdtrain.${PROTOCOL_VERSION}.${PROTOCOL_MINOR}`, `crowdtrain.${PROTOCOL_VERSION}.${PROTOCOL_MINOR - 1}`];
}

/** The minor a server accepted (a WebSocket's `protocol`); none accepted means 2.0. */
export function negotiatedMinor(protocol) {
  const match = /^crowdtrain\.2\.(0|[1-9][0-9]{0,3})$/.exec(protocol ?? "");
  return match ? Math.min(Number(match[1]), PROTOCOL_MINOR) : 0;
}

// ------------------------------------------------------------------ field types

const MAX_SAFE = Number.MAX_SAFE_INTEGER;

function integer(lo, hi, idBound = hi) {
  return (value, at) => {
    if (typeof value !== "number" || !Number.isInteger(value)) throw typeError(at, "int", value);
    if (value < lo || value > idBound) throw new ProtocolError(`${at}: expected int ${value < lo ? ">= " + lo : "<= " + idBound}`);
    if (value > hi) throw new ProtocolError(`${at}: ${value} is past what this tab reads exactly (2**53); reload the page`);
    return value;
  };
}

function real(lo, hi) {
  return (value, at) => {
    if (typeof value !== "number" || !Number.isFinite(value)) throw typeError(at, "float", value);
    if (value < lo || value > hi) throw new ProtocolError(`${at}: expected float ${value < lo ? ">= " + lo : "<= " + hi}`);
    return value;
  };
}

function string(maxLength, pattern = null) {
  return (value, at) => {
    if (typeof value !== "string") throw typeError(at, "str", value);
    if (value.length > maxLength && [...value].length > maxLength) {
      throw new ProtocolError(`${at}: expected str of length <= ${maxLength}`);
    }
    if (pattern !== null && !pattern.test(value)) throw new ProtocolError(`${at}: expected str matching ${pattern.source}`);
    return value;
  };
}

function bool(value, at) {
  if (typeof value !== "boolean") throw typeError(at, "bool", value);
  return value;
}

function choice(...values) {
  return (value, at) => {
    if (!values.includes(value)) {
      throw new ProtocolError(`${at}: invalid enum value ${JSON.stringify(value)}; expected one of ${JSON.stringify(values)}`);
    }
    return value;
  };
}

function nullable(type) {
  return (value, at) => (value === null ? null : type(value, at));
}

function list(type) {
  return (value, at, unknown) => {
    if (!Array.isArray(value)) throw typeError(at, "array", value);
    return value.map((item, i) => type(item, `${at}[${i}]`, unknown));
  };
}

function dict(keyType, valueType) {
  return (value, at) => {
    if (value === null || typeof value !== "object" || Array.isArray(value)) throw typeError(at, "object", value);
    const out = {};
    for (const [key, item] of Object.entries(value)) out[keyType(key, `${at}.${key}`)] = valueType(item, `${at}.${key}`);
    return out;
  };
}

/** A nested struct: `fields` maps each name to [type, default] (no default: required). */
function struct(fields) {
  return (value, at, unknown) => readStruct(fields, value, at, unknown);
}

const Id = integer(0, MAX_SAFE, 2 ** 63 - 1);
const Count = integer(0, MAX_SAFE, 2 ** 53);
const Version = Count;
const SliceIndex = integer(-1, 1 << 16);
const Seconds = real(0, 1e9);
const Rate = real(0, 1e21);
const Real = real(-1e30, 1e30);
const Bytes = integer(0, MAX_SAFE, 2 ** 62);
const Name = string(200);
const Text = string(8192);
const Token = string(4096);
const Url = string(2048);
const Sha256 = string(64, /^[0-9a-f]{64}$/);
const HexKey = string(64, /^(?:[0-9a-f]{64})?$/);
const BlockSize = integer(32, 1 << 16);
const ConfigScalar = (value, at) => {
  if (value === null || typeof value === "string" || typeof value === "boolean") return value;
  if (typeof value === "number" && Number.isFinite(value)) return value;
  throw typeError(at, "int | float | str | bool | null", value);
};
const ConfigValue = (value, at) => (Array.isArray(value) ? list(ConfigScalar)(value, at) : ConfigScalar(value, at));
const REQUIRED = Symbol("required");

// ------------------------------------------------------------------ parts

const DeviceInfo = {
  kind: [choice("cpu", "cuda", "mps", "browser"), REQUIRED],
  name: [Name, REQUIRED],
  memory_bytes: [Bytes, 0],
  threads: [Count, 1],
  torch_version: [Name, ""],
  flops_per_s: [Rate, 0],
  runtime: [Name, ""],
};
const RUNTIME_SINCE = 10; // DeviceInfo.runtime came with 2.10

const Receipt = { slice_index: [SliceIndex, REQUIRED], token: [Token, REQUIRED] };

const DeviceControls = {
  idle_minutes: [nullable(real(0, 1440)), null],
  max_other_cpu_percent: [nullable(real(1, 100)), null],
  schedule: [Name, ""],
  pause_on_battery: [bool, false],
  upload_kbps: [nullable(real(8, 1e8)), null],
  download_kbps: [nullable(real(8, 1e8)), null],
  threads: [nullable(integer(1, 1024)), null],
  gpu_memory_gb: [nullable(real(0.1, 4096)), null],
};

const OptimizerSpec = {
  name: [Name, "adamw"],
  lr: [Real, 1e-3],
  beta1: [Real, 0.9],
  beta2: [Real, 0.999],
  eps: [Real, 1e-8],
  weight_decay: [Real, 0],
  momentum: [Real, 0],
  warmup_steps: [Count, 0],
  schedule: [choice("constant", "cosine"), "constant"],
  min_lr_ratio: [Real, 0],
  total_steps: [nullable(Version), null],
  decay_all: [bool, false],
  extra: [dict(Name, Real), {}],
  nesterov: [bool, false],
};

const DataSpec = {
  kind: [choice("text", "tensors", "tokens"), REQUIRED],
  sample_len: [Count, 0],
  token_bytes: [choice(0, 2, 4), 0],
  vocab_size: [Count, 0],
  tokenizer: [HexKey, ""],
  augment: [choice("none", "flip", "flip_crop"), "none"],
};

// ------------------------------------------------------------------ messages

const MESSAGES = {
  // tab -> site
  hello: { protocol_version: [Version, REQUIRED], agent_version: [Name, REQUIRED], device: [struct(DeviceInfo), REQUIRED] },
  heartbeat: {},
  lease_request: {
    campaign_id: [nullable(Id), null],
    samples_per_s: [nullable(Rate), null],
    request_id: [string(64), ""],
    wait_s: [Seconds, 0],
  },
  done: {
    lease_id: [Id, REQUIRED],
    receipts: [list(struct(Receipt)), REQUIRED],
    num_samples: [Count, REQUIRED],
    loss_sum: [Real, REQUIRED],
    compute_s: [Seconds, REQUIRED],
    bytes_up: [Bytes, 0, 3],
    bytes_down: [Bytes, 0, 3],
    network_s: [Seconds, 0, 3],
  },
  release: { lease_id: [Id, REQUIRED] },
  // site -> tab
  welcome: {
    device_id: [Id, REQUIRED],
    device_name: [Name, REQUIRED],
    volunteer: [Name, REQUIRED],
    heartbeat_s: [Seconds, REQUIRED],
    gone_after_s: [Seconds, REQUIRED],
    controls: [nullable(struct(DeviceControls)), null],
  },
  controls: { controls: [nullable(struct(DeviceControls)), null] },
  lease: {
    lease_id: [Id, REQUIRED],
    campaign_id: [Id, REQUIRED],
    base_version: [Version, REQUIRED],
    ranges: [list(struct({ shard: [Sha256, REQUIRED], start: [Count, REQUIRED], count: [Count, REQUIRED] })), REQUIRED],
    num_samples: [Count, REQUIRED],
    microbatch_size: [Count, REQUIRED],
    deadline_s: [Seconds, REQUIRED],
    ticket: [Token, REQUIRED],
    codec: [choice("fp32", "fp16", "int8"), REQUIRED],
    model: [struct({ architecture: [Name, REQUIRED], config: [dict(Name, ConfigValue), REQUIRED] }), REQUIRED],
    data: [struct(DataSpec), REQUIRED],
    param_count: [Count, REQUIRED],
    slices: [
      list(
        struct({
          index: [Count, REQUIRED],
          start: [Count, REQUIRED],
          end: [Count, REQUIRED],
          upload_url: [Url, REQUIRED],
          params_url: [Url, REQUIRED],
        }),
      ),
      REQUIRED,
    ],
    prefetch: [list(string(64)), []],
    codec_block_size: [BlockSize, 256],
    mode: [choice("sync", "local"), "sync"],
    inner: [nullable(struct(OptimizerSpec)), null],
    inner_batch_size: [nullable(Count), null],
    rebase_to: [nullable(Version), null],
    mixed_precision: [bool, false],
  },
  no_lease: {
    reason: [choice("no_campaign", "campaign_paused", "step_full", "epoch_done", "campaign_finished", "quarantined"), REQUIRED],
    detail: [Text, REQUIRED],
    retry_after_s: [Seconds, REQUIRED],
    ready_at_step: [nullable(Version), null],
  },
  done_ack: {
    lease_id: [Id, REQUIRED],
    accepted: [bool, REQUIRED],
    step: [nullable(Version), null],
    reason: [Text, ""],
    verification: [choice("", "pending", "check"), ""],
  },
  release_ack: { lease_id: [Id, REQUIRED] },
  version: { campaign_id: [Id, REQUIRED], version: [Version, REQUIRED], loss: [nullable(Real), null] },
  error: { code: [Name, REQUIRED], detail: [Text, REQUIRED] },
  // aggregator -> tab, on the data channel
  receipt: { lease_id: [Id, REQUIRED], slice_index: [SliceIndex, REQUIRED], token: [Token, REQUIRED] },
  upload_rejected: {
    lease_id: [nullable(Id), REQUIRED],
    slice_index: [nullable(SliceIndex), REQUIRED],
    code: [Name, REQUIRED],
    detail: [Text, REQUIRED],
  },
};

// The struct names the agent's errors use, so a tab's log reads like an agent's.
const STRUCT_NAMES = {
  hello: "AgentHello",
  heartbeat: "Heartbeat",
  lease_request: "LeaseRequest",
  done: "LeaseDone",
  release: "LeaseRelease",
  welcome: "Welcome",
  controls: "ControlsChanged",
  lease: "Lease",
  no_lease: "NoLease",
  done_ack: "DoneAck",
  release_ack: "ReleaseAck",
  version: "VersionPublished",
  error: "ErrorMessage",
  receipt: "UploadReceipt",
  upload_rejected: "UploadRejected",
};

/** What the site may send a tab on the control channel (the agent's SITE_TO_AGENT). */
export const SITE_TO_TAB = Object.freeze(["welcome", "lease", "no_lease", "done_ack", "release_ack", "version", "error", "controls"]);
/** What an aggregator answers an upload with (AGGREGATOR_TO_AGENT). */
export const AGGREGATOR_TO_TAB = Object.freeze(["receipt", "upload_rejected", "error"]);
const TAB_SENDS = Object.freeze(["hello", "heartbeat", "lease_request", "done", "release"]);

function readStruct(fields, value, at, unknown) {
  if (value === null || typeof value !== "object" || Array.isArray(value)) throw typeError(at, "object", value);
  const out = {};
  for (const [name, [type, fallback]] of Object.entries(fields)) {
    if (!Object.hasOwn(value, name)) {
      if (fallback === REQUIRED) throw new ProtocolError(`${at}: missing field '${name}'`);
      out[name] = structuredClone(fallback);
      continue;
    }
    out[name] = type(value[name], `${at}.${name}`, unknown);
  }
  for (const name of Object.keys(value)) {
    if (!Object.hasOwn(fields, name) && !(name === "kind" && at.indexOf(".") < 0)) unknown.push(`${at}.${name}`);
  }
  return out;
}

/**
 * Parse and check one text frame from the site or an aggregator.
 *
 * @param {string} text the frame as received.
 * @param {readonly string[]} allowed the kinds this channel carries (SITE_TO_TAB or AGGREGATOR_TO_TAB).
 * @param {(kind: string, fields: string[]) => void} [onUnknown] told of fields a newer peer added,
 *   which were ignored; log them once per connection.
 * @returns {object} the message with every field present (defaults filled in), `kind` first.
 * @throws {ProtocolError} naming the field, for malformed JSON, a kind not allowed, or a bad field.
 */
export function parseMessage(text, allowed, onUnknown = () => {}) {
  if (typeof text !== "string") throw new ProtocolError("a control message is a text frame, this one is binary");
  const size = text.length > MAX_CONTROL_MESSAGE_BYTES / 4 ? new TextEncoder().encode(text).length : text.length;
  if (size > MAX_CONTROL_MESSAGE_BYTES) {
    throw new ProtocolError(`control message of ${size} bytes is over the ${MAX_CONTROL_MESSAGE_BYTES} byte limit`);
  }
  let data;
  try {
    data = JSON.parse(text);
  } catch (error) {
    throw new ProtocolError(`malformed json: ${error.message}`);
  }
  if (data === null || typeof data !== "object" || Array.isArray(data)) {
    throw new ProtocolError(`expected a JSON object, got ${Array.isArray(data) ? "an array" : data === null ? "null" : typeof data}`);
  }
  const kind = data.kind;
  if (typeof kind !== "string" || !Object.hasOwn(MESSAGES, kind)) {
    throw new ProtocolError(`unknown message kind ${JSON.stringify(String(kind).slice(0, 40))}`);
  }
  if (!allowed.includes(kind)) throw new ProtocolError(`message kind ${JSON.stringify(kind)} is not accepted on this channel`);
  return check(kind, data, onUnknown);
}

function check(kind, data, onUnknown) {
  const unknown = [];
  const message = { kind, ...readStruct(MESSAGES[kind], data, STRUCT_NAMES[kind], unknown) };
  if (unknown.length) onUnknown(kind, unknown.map((path) => path.slice(path.indexOf(".") + 1)));
  return message;
}

/**
 * The text frame of a message a tab sends, checked first: a tab never puts on the wire what the
 * site would refuse (a NaN loss, a negative count). Fields newer than the site's `minor` are left
 * out, as the agent leaves them out for an older site.
 *
 * @param {"hello" | "heartbeat" | "lease_request" | "done" | "release"} kind
 * @param {object} fields the message's wire fields (snake_case, as the protocol names them).
 * @throws {ProtocolError} naming the field that is missing or out of bounds.
 */
export function encodeMessage(kind, fields = {}, minor = PROTOCOL_MINOR) {
  if (!TAB_SENDS.includes(kind)) throw new ProtocolError(`a tab does not send ${JSON.stringify(kind)} messages`);
  const unknown = [];
  const message = { kind, ...readStruct(MESSAGES[kind], fields, STRUCT_NAMES[kind], unknown) };
  if (unknown.length) throw new ProtocolError(`${STRUCT_NAMES[kind]}: no such field ${unknown.map((p) => p.slice(p.indexOf(".") + 1)).join(", ")}`);
  for (const [name, spec] of Object.entries(MESSAGES[kind])) {
    if (spec.length > 2 && spec[2] > minor) delete message[name];
  }
  return JSON.stringify(message);
}

/** `hello`: the first message on the control channel, within the site's hello timeout. */
export function hello({ agentVersion, device }, minor = PROTOCOL_MINOR) {
  const text = encodeMessage("hello", { protocol_version: PROTOCOL_VERSION, agent_version: agentVersion, device: { kind: "browser", ...device } }, minor);
  if (minor >= RUNTIME_SINCE) return text;
  const message = JSON.parse(text);
  delete message.device.runtime; // a field newer than the site, left out as the agent leaves them out
  return JSON.stringify(message);
}

/** `heartbeat`, every `welcome.heartbeat_s`: keeps the socket open through proxies. */
export function heartbeat() {
  return encodeMessage("heartbeat");
}

/** `lease_request`; `wait_s` lets the site hold it until a commit makes room (the agent sends 10). */
export function leaseRequest(fields = {}) {
  return encodeMessage("lease_request", fields);
}

/** `done` with one receipt per slice: the site counts the lease only with a valid receipt for every slice. */
export function done(fields, minor = PROTOCOL_MINOR) {
  return encodeMessage("done", fields, minor);
}

/** `release`: the tab gives a lease back (closed, or a gradient that cannot be sent); its samples are redone. */
export function release(leaseId) {
  return encodeMessage("release", { lease_id: leaseId });
}

/** Why no lease was given, as a person reads it; the same words as the agent's status and My devices. */
export function noLeaseWhy(reason, detail) {
  const words = reason.replaceAll("_", " ");
  return detail ? `${words}: ${detail}` : words;
}

function typeError(at, expected, value) {
  const got = value === null ? "null" : Array.isArray(value) ? "array" : typeof value === "number" ? (Number.isInteger(value) ? "int" : "float") : typeof value === "boolean" ? "bool" : typeof value === "string" ? "str" : typeof value;
  return new ProtocolError(`${at}: expected ${expected}, got ${got}`);
}
