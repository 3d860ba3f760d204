"""The home-link lines: every one printed whatever happens, loss gaps against sync fp32, bytes per sample."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tests.benchmarks.figures import BaselinePair
from tests.benchmarks.homelink_figures import (
    NoResult,
    RunResult,
    figure_lines,
    figure_names,
    link_figures,
    loss_curve,
    loss_curves_svg,
    loss_gap,
    refusal_reason,
    warmup_steps,
)
from tests.benchmarks.shaping import LinkBytes, LinkRates

LINK = LinkRates(up_mbit=19.1, down_mbit=96.0)
STEADY = BaselinePair(2000.0, 2100.0)


def _shaped(rate: float, loss: float) -> RunResult:
    return RunResult(samples=49152, val_loss=loss, samples_per_s=rate, bytes_up_per_sample=1300.0,
                     bytes_down_per_sample=6200.0)  # fmt: skip


def _lines(w1: dict, gpt: dict, baseline: BaselinePair = STEADY) -> dict[str, str]:
    lines = figure_lines(LINK, baseline, w1, gpt, w1_note="W1", gpt_note="GPT, 8192 samples")
    return {line.split("=", 1)[0].removeprefix("bench: "): line.split("=", 1)[1] for line in lines}


def test_it_prints_every_line_in_order_when_all_runs_worked() -> None:
    w1 = {"sync_fp32": _shaped(500.0, 1.0), "sync_int8": _shaped(1400.0, 1.005), "local_int8": _shaped(1950.0, 0.98)}
    gpt = {name: RunResult(samples=8192, val_loss=2.0) for name in w1}

    lines = figure_lines(LINK, STEADY, w1, gpt, w1_note="W1", gpt_note="GPT")

    assert [line.split("=", 1)[0].removeprefix("bench: ") for line in lines] == figure_names()


def test_efficiency_is_the_rate_over_the_best_baseline() -> None:
    w1 = {"sync_fp32": _shaped(525.0, 1.0), "sync_int8": _shaped(1400.0, 1.0), "local_int8": _shaped(1890.0, 1.0)}

    lines = _lines(w1, {})

    assert lines["home_link_efficiency_sync_fp32"] == "0.250"
    assert lines["home_link_efficiency_local_int8"] == "0.900"
    assert lines["bytes_up_per_sample_sync_int8"] == "1300.0"


def test_loss_gaps_compare_with_sync_fp32_after_the_same_samples() -> None:
    w1 = {"sync_fp32": _shaped(500.0, 2.0), "sync_int8": _shaped(1400.0, 2.01), "local_int8": _shaped(1900.0, 1.9)}

    lines = _lines(w1, {})

    assert lines["int8_loss_gap"].startswith("0.005 (W1: val loss 2.010 vs 2.000 after 49152 samples)")
    assert lines["local_loss_gap"].startswith("-0.050 ")
    assert loss_gap(2.06, 2.0) == pytest.approx(0.03)


def test_a_local_run_whose_campaign_was_refused_says_skipped_on_each_of_its_lines() -> None:
    refused = NoResult("skipped", "campaign not created: unknown campaign field(s) ['inner_optimizer']")
    w1 = {"sync_fp32": _shaped(500.0, 2.0), "sync_int8": _shaped(1400.0, 2.01), "local_int8": refused}

    lines = _lines(w1, {"sync_fp32": RunResult(8192, 2.0), "sync_int8": RunResult(8192, 2.0), "local_int8": refused})

    for name in ("home_link_samples_per_s_local_int8", "home_link_efficiency_local_int8",
                 "bytes_up_per_sample_local_int8", "bytes_down_per_sample_local_int8"):  # fmt: skip
        assert lines[name] == f"skipped ({refused.reason})"
    assert lines["local_loss_gap"] == f"skipped (local_int8: {refused.reason})"
    assert lines["local_loss_gap_gpt"] == f"skipped (local_int8: {refused.reason})"
    assert lines["int8_loss_gap"].startswith("0.005")


def test_a_broken_reference_run_fails_the_gaps_that_need_it() -> None:
    w1 = {"sync_fp32": NoResult("failed", "LaunchError: site exited"), "sync_int8": _shaped(1400.0, 2.01)}

    lines = _lines(w1, {})

    assert lines["int8_loss_gap"] == "failed (sync_fp32: LaunchError: site exited)"
    assert lines["home_link_efficiency_local_int8"] == "failed (not run)"
    assert lines["int8_loss_gap_gpt"] == "failed (no sync_fp32 run)"


def test_runs_of_different_lengths_give_no_gap() -> None:
    w1 = {"sync_fp32": _shaped(500.0, 2.0), "sync_int8": RunResult(40960, 2.0, 1.0, 1.0, 1.0)}

    assert _lines(w1, {})["int8_loss_gap"] == "failed (sync_int8 ran 40960 samples, sync_fp32 49152)"


def test_efficiency_says_unstable_when_the_baselines_disagree() -> None:
    w1 = {"sync_fp32": _shaped(500.0, 2.0)}

    lines = _lines(w1, {}, baseline=BaselinePair(1000.0, 2000.0))

    assert lines["home_link_efficiency_sync_fp32"].startswith("unstable")
    assert "unstable" in lines["home_link_baseline_samples_per_s"]


def _step(t: float, samples: int = 1024) -> dict:
    return {"num_samples": samples, "committed_at": datetime.fromtimestamp(t, tz=UTC).isoformat()}


def test_bytes_per_sample_count_from_the_warm_up_commit_to_the_last_but_one() -> None:
    steps = [_step(t) for t in (10.0, 12.0, 14.0, 16.0, 18.0)]
    # 1000 bytes up and 5000 down per second; the last step's bytes (the site's final fetch) are far more.
    series = [LinkBytes(t, 1000 * int(t), 5000 * int(t)) for t in range(9, 18)] + [LinkBytes(19.0, 10**9, 10**9)]

    up, down = link_figures(steps, series, warmup=1)

    # 12 s -> 16 s: 4 s of traffic over steps 2 and 3, 2048 samples
    assert up == pytest.approx(4000 / 2048)
    assert down == pytest.approx(20000 / 2048)


def test_bytes_need_a_window_after_the_warm_up() -> None:
    with pytest.raises(RuntimeError, match="only 3 steps"):
        link_figures([_step(1.0), _step(2.0), _step(3.0)], [LinkBytes(0.0, 0, 0), LinkBytes(4.0, 0, 0)], warmup=1)


def test_warm_up_is_at_least_one_step() -> None:
    assert warmup_steps(8192, 1024) == 8
    assert warmup_steps(8192, 8192) == 1
    assert warmup_steps(0, 8192) == 1


def test_a_refused_campaign_is_explained_by_seed_runs_last_line() -> None:
    message = (
        "manage.py seed_run --migrate --spec x failed (1):\nTraceback...\n"
        "CommandError: unknown campaign field(s) ['inner_optimizer', 'training_mode']; known: [...]\n"
    )

    assert refusal_reason(message) == "CommandError: unknown campaign field(s) ['inner_optimizer', 'training_mode']"


def test_the_loss_curves_picture_draws_each_run_that_has_one_and_its_validation_loss() -> None:
    steps = [{"num_samples": 1024, "loss_sum": 1024 * loss} for loss in (2.0, 1.5, 1.0)]
    curve = loss_curve(steps)
    assert curve == ((1024, 2.0), (2048, 1.5), (3072, 1.0))
    runs = {
        "sync_fp32": RunResult(samples=3072, val_loss=1.1, curve=curve),
        "local_int8": RunResult(samples=3072, val_loss=0.9, curve=((3072, 1.2),)),
        "sync_int8": NoResult("skipped", "--runs"),
    }

    svg = loss_curves_svg(runs, "W1 <home link>")

    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count("<polyline") == 3  # the axes and one curve per run with one
    assert "sync_fp32: val 1.100" in svg and "local_int8: val 0.900" in svg and "sync_int8" not in svg
    assert "W1 &lt;home link&gt;" in svg
    with pytest.raises(ValueError, match="no run has a loss curve"):
        loss_curves_svg({"sync_int8": NoResult("failed", "broke")}, "nothing")
