"""What a campaign's changes tell the layers above it, which campaigns never imports (the scheduler, the gateway).

Each carries plain data (ids and numbers); the receivers connect in their ``AppConfig.ready``.
"""

from __future__ import annotations

from django.dispatch import Signal

# A campaign started or resumed: ``campaign_id``, ``version``. Sent after its state is saved.
campaign_running = Signal()

# A campaign's row changed behind the ORM's save (a queryset update): ``campaign_id``. Every site
# process re-reads it before its next lease, as after a save of a field the lease path reads.
campaign_changed = Signal()
