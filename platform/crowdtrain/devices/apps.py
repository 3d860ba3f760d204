from __future__ import annotations

from django.apps import AppConfig


class DevicesConfig(AppConfig):
    """Volunteers' devices as services and pages: logging an agent in, what it does, its controls, revoking it.

    Above the scheduler (a device's presence and leases) and below verification (which revokes); the
    ``Device`` row itself is the accounts app's.
    """

    name = "crowdtrain.devices"
    label = "devices"
    verbose_name = "Devices"
