"""How a site process reads its own load: lease calls in hand, and how late its event loop runs."""

from __future__ import annotations

from django.test import override_settings

from crowdtrain.gateway.admission import MAX_RETRY_AFTER_S, Admission


@override_settings(CROWDTRAIN_MAX_LEASE_CALLS=10)
def test_the_load_is_the_larger_of_calls_in_hand_and_loop_lag() -> None:
    idle, calls, lagging = Admission(), Admission(lease_calls=5), Admission(loop_lag_s=0.5)

    assert (idle.load, calls.load, lagging.load) == (0.0, 0.5, 1.0)
    assert idle.retry_after(2.0) == 2.0
    assert calls.retry_after(2.0) == 2.0 * 3.0
    assert Admission(lease_calls=1000).retry_after(2.0) == MAX_RETRY_AFTER_S
