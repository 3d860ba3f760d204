from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [
    path("api/campaigns/<int:campaign_id>/browser/", views.campaign_browser, name="campaign-browser"),
    path("browser/graphs/<str:sha256>.onnx", views.graph_bytes, name="browser-graph"),
]
