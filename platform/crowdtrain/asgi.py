"""ASGI entry point: HTTP through Django, WebSockets through the gateway's consumers.

daphne -b 127.0.0.1 -p 8000 crowdtrain.asgi:application
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crowdtrain.settings")
django_asgi_app = get_asgi_application()

# Static files come through Django's middleware (WhiteNoise, settings.py), with DEBUG on or off.
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up first)

from crowdtrain.gateway.routing import websocket_urlpatterns  # noqa: E402

# Agents and aggregators are not browsers: they authenticate with bearer
# tokens, not cookies, so no session or origin middleware sits in front.
application = ProtocolTypeRouter({"http": django_asgi_app, "websocket": URLRouter(websocket_urlpatterns)})
