from __future__ import annotations

from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from .consumers import AgentConsumer, BackboneConsumer
from .dashboard import DashboardConsumer

websocket_urlpatterns = [
    path("ws/agent/", AgentConsumer.as_asgi()),
    path("ws/backbone/", BackboneConsumer.as_asgi()),
    # A browser page: its session cookie says who is watching, and the origin check keeps other
    # sites' pages from opening it with an admin's cookie. Agents and aggregators never pass here.
    path("ws/dashboard/", AllowedHostsOriginValidator(AuthMiddlewareStack(DashboardConsumer.as_asgi()))),
]
