from __future__ import annotations

from django.urls import path

from .consumers import AgentConsumer, BackboneConsumer

websocket_urlpatterns = [
    path("ws/agent/", AgentConsumer.as_asgi()),
    path("ws/backbone/", BackboneConsumer.as_asgi()),
]
