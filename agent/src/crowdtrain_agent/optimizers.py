"""The optimizer registry: every optimizer aggregators can apply, its hyperparameters and their bounds.

Like the model registry, this is the one list the whole platform reads: the
site builds its form and validates campaigns from it, and the aggregator
builds each slice's optimizer from it. It imports neither torch nor Django;
an entry names its aggregator-side builder as ``"module:function"``, which
only the aggregator imports (see ``crowdtrain_backbone.optimizers``).

Adding an optimizer is one ``register(OptimizerEntry(...))`` here plus its
builder (and step function) on the aggregator side; its fields then appear in
the campaign form by themselves.

Terms: a *hyperparameter* is a value the organizer picks per campaign (``lr``,
``beta1``...). A hyperparameter name means the same thing, with the same
bounds, in every optimizer that declares it, so the form has one field per
name and an organizer's learning rate survives switching optimizers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .fields import ConfigError, ConfigField
from .protocol import OptimizerSpec
from .protocol.schema import to_dict

DEFAULT_OPTIMIZER = "adamw"
# What an agent runs itself as a local-mode campaign's inner optimizer: elementwise optimizers torch builds
# (LAMB's trust ratio is the aggregator's own code).
INNER_OPTIMIZERS = ("adamw", "sgd")


class OptimizerConfigError(ConfigError):
    """An optimizer or schedule setting that cannot be trained with; ``field`` is the hyperparameter's name."""


@dataclass(frozen=True)
class OptimizerEntry:
    """How the platform knows one optimizer.

    ``per_tensor`` optimizers look at whole model tensors in their update
    (LAMB's trust ratio is a ratio of tensor norms), so the site cuts their
    campaigns' slices only between tensors. ``builder`` is the aggregator's
    ``"module:function"`` that makes the torch optimizer for one slice.
    """

    name: str
    label: str
    description: str
    hyperparameters: dict[str, ConfigField]
    builder: str
    per_tensor: bool = False
    # Raises OptimizerConfigError when hyperparameters that are each in bounds do not go together.
    check_together: Callable[[Mapping[str, Any]], None] | None = None

    def validate(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """This optimizer's hyperparameters from ``values``, defaults filled in and every bound checked.

        Keys this optimizer does not declare are ignored: a campaign's stored
        optimizer also holds the unused fields of the wire format.

        Raises:
            OptimizerConfigError: naming the hyperparameter, its value and the accepted range.
        """
        checked = {
            name: spec.check(values.get(name, spec.default), setting_name(name), field=name, error=OptimizerConfigError)
            for name, spec in self.hyperparameters.items()
        }
        if self.check_together is not None:
            self.check_together(checked)
        return checked


def setting_name(name: str) -> str:
    """How messages name optimizer setting ``name``: its label for a person, its key for a JSON spec."""
    spec = HYPERPARAMETERS.get(name) or SCHEDULE.get(name)
    label = spec.label if spec and spec.label else name
    return f"{label} (optimizer.{name})" if label != name else f"optimizer.{name}"


# ---------------------------------------------------------------------- hyperparameters shared by name

LR = ConfigField("float", 1e-3, 0.0, 10.0, "peak learning rate", "Learning rate", open_minimum=True)
BETA1 = ConfigField("float", 0.9, 0.0, 1.0, "first-moment decay", "beta1", open_maximum=True)
BETA2 = ConfigField("float", 0.999, 0.0, 1.0, "second-moment decay", "beta2", open_maximum=True)
EPS = ConfigField("float", 1e-8, 0.0, 1.0, "added to the denominator", "eps", open_minimum=True)
MOMENTUM = ConfigField("float", 0.0, 0.0, 1.0, "heavy-ball momentum; 0 is plain SGD", "Momentum", open_maximum=True)
WEIGHT_DECAY = ConfigField(
    "float",
    0.0,
    0.0,
    1.0,
    "on matrices and embeddings; biases and norm gains only with Decay every tensor",
    "Weight decay",
)
# nanoGPT's rule, and most trainers': biases and norm gains (tensors of fewer than 2 dimensions) are not
# decayed. The aggregator applies it per model tensor from the registry's parameter shapes, so slices
# compose with the full model; this switch decays every tensor instead.
DECAY_ALL = ConfigField(
    "bool",
    False,
    help="decay biases and norm gains too (default: only tensors of 2 or more dimensions)",
    label="Decay every tensor",
)

NESTEROV = ConfigField(
    "bool",
    False,
    help="Nesterov momentum (needs a momentum above 0); DiLoCo's outer optimizer uses it",
    label="Nesterov",
)

# The learning-rate schedule: the same for every optimizer (the aggregator sets each step's rate).
SCHEDULE: dict[str, ConfigField] = {
    "warmup_steps": ConfigField("int", 0, 0, 1 << 30, "linear warmup from 0 over this many steps", "Warmup steps"),
    "schedule": ConfigField(
        "choice",
        "constant",
        help="after warmup: constant, or cosine decay until max steps",
        label="Schedule",
        choices=("constant", "cosine"),
    ),
    "min_lr_ratio": ConfigField("float", 0.0, 0.0, 1.0, "the cosine ends at lr × this", "Minimum LR ratio"),
    "total_steps": ConfigField(
        "int", None, 1, 1 << 30, "the step where a cosine decay ends", "Total steps", optional=True
    ),
}

OPTIMIZERS: dict[str, OptimizerEntry] = {}
# Every hyperparameter name any optimizer declares, with its one spec (see ``register``).
HYPERPARAMETERS: dict[str, ConfigField] = {}


def register(entry: OptimizerEntry) -> OptimizerEntry:
    """Add ``entry`` to the registry (tests register throwaway ones; ``unregister`` removes them).

    Raises:
        ValueError: if the name is taken, or a hyperparameter reuses a name with other bounds or
            clashes with a schedule field.
    """
    if entry.name in OPTIMIZERS:
        raise ValueError(f"optimizer {entry.name!r} is registered already")
    for name, spec in entry.hyperparameters.items():
        if name in SCHEDULE or name in ("name", "extra"):
            raise ValueError(f"optimizer {entry.name!r}: {name!r} is a schedule or wire field, not a hyperparameter")
        known = HYPERPARAMETERS.get(name)
        if known is not None and known != spec:
            raise ValueError(
                f"optimizer {entry.name!r}: hyperparameter {name!r} is declared with other bounds by another "
                "optimizer; reuse that spec or give this one another name"
            )
    OPTIMIZERS[entry.name] = entry
    for name, spec in entry.hyperparameters.items():
        HYPERPARAMETERS.setdefault(name, spec)
    return entry


def unregister(name: str) -> None:
    """Remove optimizer ``name`` and the hyperparameters only it declared."""
    OPTIMIZERS.pop(name, None)
    used = {h for entry in OPTIMIZERS.values() for h in entry.hyperparameters}
    for hyper in [h for h in HYPERPARAMETERS if h not in used]:
        del HYPERPARAMETERS[hyper]


def get_optimizer(name: Any) -> OptimizerEntry:
    """Look up an optimizer by name; an unknown name is an error, never a silent default.

    Raises:
        OptimizerConfigError: (field ``name``) listing the optimizers this version knows.
    """
    entry = OPTIMIZERS.get(name) if isinstance(name, str) else None
    if entry is None:
        known = ", ".join(f"{n} ({e.label})" for n, e in sorted(OPTIMIZERS.items()))
        raise OptimizerConfigError(
            f"unknown optimizer {name!r}; this version knows {known}. Upgrade crowdtrain-agent (site and "
            "aggregators) if the campaign needs a newer one.",
            "name",
        )
    return entry


def wire_fields() -> frozenset[str]:
    """The fields of this protocol version's OptimizerSpec (they carry the hyperparameters to aggregators)."""
    return frozenset(to_dict(OptimizerSpec()))


def stored_value(config: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """Hyperparameter ``name`` of a stored optimizer (a campaign's JSON or a spec's dict): own field or ``extra``."""
    if name in config:
        return config[name]
    extra = config.get("extra")
    if isinstance(extra, Mapping) and name in extra:
        return extra[name]
    return default


def hyperparameters_of(spec: OptimizerSpec) -> dict[str, Any]:
    """The validated hyperparameters of ``spec``'s optimizer (the aggregator's view of an assignment).

    Raises:
        OptimizerConfigError: for an unknown optimizer or a value out of bounds.
    """
    data = to_dict(spec)
    entry = get_optimizer(data.get("name"))
    values = {name: stored_value(data, name, field.default) for name, field in entry.hyperparameters.items()}
    for name, field in entry.hyperparameters.items():
        if field.kind == "bool" and isinstance(values[name], (int, float)) and not isinstance(values[name], bool):
            values[name] = bool(values[name])  # ``extra`` carries numbers only
        elif field.kind == "int" and isinstance(values[name], float) and values[name].is_integer():
            values[name] = int(values[name])
    return entry.validate(values)


def validate_config(config: Mapping[str, Any]) -> tuple[OptimizerEntry, dict[str, Any], dict[str, Any]]:
    """Check an optimizer config as organizers and specs write it: ``{"name": ..., "lr": ..., ...}``.

    Returns:
        (entry, its hyperparameters, the schedule fields), with defaults filled in. Hyperparameters
        of other optimizers that the config carries (a stored campaign holds the whole wire
        format) are checked against their own bounds and returned with the entry's.

    Raises:
        OptimizerConfigError: naming the first bad field.
    """
    if not isinstance(config, Mapping):
        raise OptimizerConfigError(f"optimizer must be an object, got {type(config).__name__}", "name")
    entry = get_optimizer(config.get("name", DEFAULT_OPTIMIZER))
    extra = config.get("extra") or {}
    if not isinstance(extra, Mapping):
        raise OptimizerConfigError(f"optimizer.extra must be an object, got {type(extra).__name__}", "name")
    known = {"name", "extra", *SCHEDULE, *HYPERPARAMETERS, *wire_fields()}
    unknown = sorted((set(config) - known) | (set(extra) - set(HYPERPARAMETERS)))
    if unknown:
        raise OptimizerConfigError(
            f"optimizer: unknown field {unknown[0]!r}; {entry.label} takes {', '.join(entry.hyperparameters)} "
            f"and the schedule fields {', '.join(SCHEDULE)}",
            "name",
        )
    others = {
        name: spec.check(stored_value(config, name), setting_name(name), field=name, error=OptimizerConfigError)
        for name, spec in HYPERPARAMETERS.items()
        if name not in entry.hyperparameters and stored_value(config, name) is not None
    }
    hyper = entry.validate(
        {name: stored_value(config, name, spec.default) for name, spec in entry.hyperparameters.items()}
    )
    schedule = {
        name: spec.check(config.get(name, spec.default), setting_name(name), field=name, error=OptimizerConfigError)
        for name, spec in SCHEDULE.items()
    }
    return entry, {**others, **hyper}, schedule


def to_wire(name: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The OptimizerSpec fields for ``values`` (hyperparameters and schedule), as this protocol can carry them.

    A hyperparameter without a field of its own travels in ``extra`` when the
    protocol has it; one that cannot travel at all may only keep its default.

    Raises:
        OptimizerConfigError: naming a hyperparameter set away from its default that this protocol cannot carry.
    """
    fields = wire_fields()
    wire: dict[str, Any] = {"name": name}
    extra: dict[str, float] = {}
    for key, value in values.items():
        if key in fields:
            wire[key] = value
        elif "extra" in fields and value is not None:
            extra[key] = float(value)
        elif value != HYPERPARAMETERS[key].default:
            raise OptimizerConfigError(
                f"{setting_name(key)}: this site's protocol cannot send it to aggregators yet, so it must stay "
                f"{HYPERPARAMETERS[key].default!r}; upgrade crowdtrain-agent on the site and the aggregators",
                key,
            )
    if extra:
        wire["extra"] = extra
    return wire


# ---------------------------------------------------------------------- the optimizers

# AdamW and LAMB take the same hyperparameters (LAMB adds its per-tensor trust ratio, which has none).
ADAM_FAMILY = {
    "lr": LR,
    "beta1": BETA1,
    "beta2": BETA2,
    "eps": EPS,
    "weight_decay": WEIGHT_DECAY,
    "decay_all": DECAY_ALL,
}
register(
    OptimizerEntry(
        name="adamw",
        label="AdamW",
        description="Adam with decoupled weight decay (Loshchilov and Hutter, 2019).",
        hyperparameters=dict(ADAM_FAMILY),
        builder="crowdtrain_backbone.optimizers:build_adamw",
    )
)


def _nesterov_needs_momentum(values: Mapping[str, Any]) -> None:
    if values.get("nesterov") and not values.get("momentum"):
        raise OptimizerConfigError(
            f"{setting_name('nesterov')} needs a momentum above 0 (DiLoCo's outer optimizer uses 0.9); "
            "set a momentum or turn Nesterov off",
            "nesterov",
        )


register(
    OptimizerEntry(
        name="sgd",
        label="SGD with momentum",
        description="Stochastic gradient descent with heavy-ball momentum.",
        hyperparameters={
            "lr": LR,
            "momentum": MOMENTUM,
            "nesterov": NESTEROV,
            "weight_decay": WEIGHT_DECAY,
            "decay_all": DECAY_ALL,
        },
        builder="crowdtrain_backbone.optimizers:build_sgd",
        check_together=_nesterov_needs_momentum,
    )
)
register(
    OptimizerEntry(
        name="lamb",
        label="LAMB",
        description="Layer-wise adaptive large-batch optimizer (You et al., 2019).",
        hyperparameters=dict(ADAM_FAMILY),
        builder="crowdtrain_backbone.lamb:build_lamb",
        per_tensor=True,
    )
)
