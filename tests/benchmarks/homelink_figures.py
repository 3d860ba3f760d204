"""The home-link benchmark's figures: which lines it prints, loss gaps, bytes per sample, skipped and failed runs.

Pure functions, so ``tests/bench_support`` can check them without a namespace or a site.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from .figures import BaselinePair, figure_line, format_value, ratio_or_unstable
from .shaping import LinkBytes, LinkRates, bytes_between


@dataclass(frozen=True)
class Mode:
    """One way of training a campaign: the wire codec and the training mode."""

    name: str
    codec: Literal["fp32", "int8"]
    training_mode: Literal["sync", "local"]


MODES = (Mode("sync_fp32", "fp32", "sync"), Mode("sync_int8", "int8", "sync"), Mode("local_int8", "int8", "local"))
REFERENCE = "sync_fp32"
# The lines of each W1 run, as PREFIX_RUN.
RUN_FIGURES = ("home_link_samples_per_s", "home_link_efficiency", "bytes_up_per_sample", "bytes_down_per_sample")
GAPS = {"int8_loss_gap": "sync_int8", "local_loss_gap": "local_int8"}  # loss-gap line -> the run it compares


@dataclass(frozen=True)
class RunResult:
    """What one campaign run measured."""

    samples: int  # committed over the whole run
    val_loss: float  # held-out loss of the final version
    samples_per_s: float | None = None  # steady state; None for a run that only compares losses
    bytes_up_per_sample: float | None = None
    bytes_down_per_sample: float | None = None
    # (samples committed so far, the step's training loss) per committed step: a round's in local mode is
    # the mean over its inner steps, so it lags a sync step's at the same sample count.
    curve: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class NoResult:
    """A run that gave no figures, and why: ``skipped`` (it could not be set up) or ``failed`` (it broke)."""

    verdict: Literal["skipped", "failed"]
    reason: str

    def line(self, name: str) -> str:
        return f"bench: {name}={self.verdict} ({self.reason})"


Outcome = RunResult | NoResult


def figure_names() -> list[str]:
    """Every line this benchmark prints, in order: whatever happens, each of them is printed."""
    names = ["home_link_up_Mbps", "home_link_down_Mbps", "home_link_baseline_samples_per_s"]
    for mode in MODES:
        names += [f"{prefix}_{mode.name}" for prefix in RUN_FIGURES]
    return names + [*GAPS, *(f"{gap}_gpt" for gap in GAPS)]


def skipped_lines(reason: str) -> list[str]:
    """The whole phase could not run (no namespace): every line says so."""
    return [NoResult("skipped", reason).line(name) for name in figure_names()]


def loss_gap(loss: float, reference: float) -> float:
    """How much higher ``loss`` is than ``reference``, as a fraction of it (negative: lower)."""
    if reference <= 0 or not math.isfinite(reference):
        raise ValueError(f"a reference loss must be positive and finite, got {reference!r}")
    return loss / reference - 1.0


def loss_gap_line(name: str, runs: dict[str, Outcome], compared: str, what: str) -> str:
    """The line of ``runs[compared]``'s loss gap against ``runs[REFERENCE]``, or why there is none."""
    ref, got = runs.get(REFERENCE), runs.get(compared)
    for run, outcome in ((REFERENCE, ref), (compared, got)):
        if outcome is None:
            return NoResult("failed", f"no {run} run").line(name)
        if isinstance(outcome, NoResult):
            return NoResult(outcome.verdict, f"{run}: {outcome.reason}").line(name)
    if not isinstance(ref, RunResult) or not isinstance(got, RunResult):  # narrowed above; for the type checker
        raise TypeError("loss_gap_line needs two run results")
    if ref.samples != got.samples:
        return NoResult("failed", f"{compared} ran {got.samples} samples, {REFERENCE} {ref.samples}").line(name)
    note = f"{what}: val loss {format_value(got.val_loss)} vs {format_value(ref.val_loss)} after {ref.samples} samples"
    return figure_line(name, loss_gap(got.val_loss, ref.val_loss), note)


def figure_lines(
    link: LinkRates,
    baseline: BaselinePair | NoResult,
    w1: dict[str, Outcome],
    gpt: dict[str, Outcome],
    *,
    w1_note: str,
    gpt_note: str,
) -> list[str]:
    """Every line of ``figure_names``, from the link check, the baselines and the runs' outcomes."""
    lines = [figure_line("home_link_up_Mbps", link.up_mbit), figure_line("home_link_down_Mbps", link.down_mbit)]
    if isinstance(baseline, NoResult):
        lines.append(baseline.line("home_link_baseline_samples_per_s"))
    else:
        unstable = (
            ""
            if baseline.agrees()
            else (f"unstable: {format_value(baseline.before)} before, {format_value(baseline.after)} after")
        )
        lines.append(figure_line("home_link_baseline_samples_per_s", baseline.best, unstable))
    for mode in MODES:
        outcome = w1.get(mode.name, NoResult("failed", "not run"))
        names = [f"{prefix}_{mode.name}" for prefix in RUN_FIGURES]
        if isinstance(outcome, NoResult):
            lines += [outcome.line(name) for name in names]
            continue
        up, down = outcome.bytes_up_per_sample, outcome.bytes_down_per_sample
        if outcome.samples_per_s is None or up is None or down is None:
            raise ValueError(f"W1 run {mode.name} measured no rate or bytes")
        lines.append(figure_line(names[0], outcome.samples_per_s))
        if isinstance(baseline, NoResult):
            lines.append(NoResult(baseline.verdict, f"no baseline: {baseline.reason}").line(names[1]))
        else:
            lines.append(ratio_or_unstable(names[1], outcome.samples_per_s, baseline))
        lines.append(figure_line(names[2], up))
        lines.append(figure_line(names[3], down))
    lines += [loss_gap_line(name, w1, compared, w1_note) for name, compared in GAPS.items()]
    lines += [loss_gap_line(f"{name}_gpt", gpt, compared, gpt_note) for name, compared in GAPS.items()]
    return lines


def commit_time(step: dict[str, Any]) -> float:
    return datetime.fromisoformat(step["committed_at"]).timestamp()


def link_figures(steps: Sequence[dict[str, Any]], series: Sequence[LinkBytes], warmup: int) -> tuple[float, float]:
    """Bytes up and down per committed sample, between the commit of step ``warmup`` and the last-but-one commit.

    The last step is left out: at the finish the site fetches the final
    parameters for validation from the aggregator's agent-facing address,
    which would count as the agent's download.

    Raises:
        RuntimeError: if fewer than ``warmup + 3`` steps committed (no window).
    """
    if len(steps) < warmup + 3:
        raise RuntimeError(f"only {len(steps)} steps committed; bytes need more than warm-up {warmup} + 2")
    window = steps[warmup + 1 : -1]
    samples = sum(s["num_samples"] for s in window)
    up, down = bytes_between(series, commit_time(steps[warmup]), commit_time(steps[-2]))
    return up / samples, down / samples


def warmup_steps(warmup_samples: int, batch: int) -> int:
    """Steps left out of steady-state figures: at least one (the first lease pays for start-up)."""
    return max(1, math.ceil(warmup_samples / batch))


def refusal_reason(message: str) -> str:
    """What a failed ``manage.py seed_run`` said, short enough for a bench line.

    Its last non-empty line, up to the first ``"; "``: Django's CommandError
    goes on with every field it knows, which the run's log keeps.
    """
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1].split("; ")[0] if lines else "seed_run failed"


def loss_curve(steps: Sequence[dict[str, Any]]) -> tuple[tuple[int, float], ...]:
    """(samples so far, training loss per sample) after each committed step of a run's dump."""
    points, seen = [], 0
    for step in steps:
        seen += int(step["num_samples"])
        if step["num_samples"]:
            points.append((seen, float(step["loss_sum"]) / int(step["num_samples"])))
    return tuple(points)


CURVE_COLOURS = {"sync_fp32": "#1f77b4", "sync_int8": "#2ca02c", "local_int8": "#d62728"}
_W, _H, _PAD = 640, 360, 48


def loss_curves_svg(runs: dict[str, Outcome], title: str) -> str:
    """The runs' training-loss curves against samples seen, and each final validation loss as a dot, as SVG.

    A picture for the closing note and the reader of ``make bench``: where the
    loss gap lines give one number, this shows whether the runs converge alike.

    Raises:
        ValueError: if no run has a curve to draw.
    """
    curves = {name: o for name, o in runs.items() if isinstance(o, RunResult) and o.curve}
    if not curves:
        raise ValueError("no run has a loss curve to draw")
    xs = [x for o in curves.values() for x, _ in o.curve]
    ys = [y for o in curves.values() for _, y in o.curve] + [o.val_loss for o in curves.values()]
    x_max, y_max = max(xs), max(ys) * 1.05
    y_min = min(0.0, min(ys))

    def at(x: float, y: float) -> str:
        px = _PAD + (_W - 2 * _PAD) * x / x_max
        py = _H - _PAD - (_H - 2 * _PAD) * (y - y_min) / (y_max - y_min)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
        'font-family="sans-serif" font-size="12">',
        f"<title>{_escape(title)}</title>",
        f'<rect width="{_W}" height="{_H}" fill="white"/>',
        f'<text x="{_W / 2}" y="20" text-anchor="middle" font-size="14">{_escape(title)}</text>',
        f'<polyline points="{at(0, y_max)} {at(0, y_min)} {at(x_max, y_min)}" fill="none" stroke="#444"/>',
        f'<text x="{_W / 2}" y="{_H - 10}" text-anchor="middle">samples seen</text>',
        f'<text x="12" y="{_H / 2}" transform="rotate(-90 12 {_H / 2})" text-anchor="middle">loss per sample</text>',
    ]
    for tick in (y_min, (y_min + y_max) / 2, y_max):
        x, y = at(0, tick).split(",")
        parts.append(f'<text x="{float(x) - 4}" y="{float(y) + 4}" text-anchor="end">{tick:.2f}</text>')
    for tick in (x_max / 4, x_max / 2, 3 * x_max / 4, x_max):
        x, y = at(tick, y_min).split(",")
        parts.append(f'<text x="{x}" y="{float(y) + 16}" text-anchor="middle">{round(tick):,}</text>')
    for row, (name, outcome) in enumerate(curves.items()):
        colour = CURVE_COLOURS.get(name, "#555")
        points = " ".join(at(x, y) for x, y in outcome.curve)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        vx, vy = at(outcome.curve[-1][0], outcome.val_loss).split(",")
        parts.append(f'<circle cx="{vx}" cy="{vy}" r="4" fill="{colour}"><title>{name} validation loss '
                     f"{outcome.val_loss:.4f}</title></circle>")  # fmt: skip
        label_y = 44 + 16 * row
        parts.append(f'<line x1="{_W - 200}" y1="{label_y - 4}" x2="{_W - 180}" y2="{label_y - 4}" '
                     f'stroke="{colour}" stroke-width="2"/>')  # fmt: skip
        parts.append(f'<text x="{_W - 174}" y="{label_y}">{_escape(name)}: val {outcome.val_loss:.3f} (dot)</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
