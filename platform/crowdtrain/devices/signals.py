"""What happens to a device that its agent's open connection must hear; the gateway, above us, connects to them.

Each carries plain data; receivers run in the sender's thread, so a revoked agent is disconnected before
the page that revoked it answers.
"""

from __future__ import annotations

from django.dispatch import Signal

# A device's token was revoked: ``device_id``, ``reason``. Its agent's sockets close with 4003.
device_revoked = Signal()

# A volunteer changed a device's controls on My devices: ``device_id``, ``controls`` (as stored; {} for none).
device_controls_changed = Signal()
