from __future__ import annotations

from django.contrib import admin
from django.urls import path

from crowdtrain.campaigns import views as campaign_views

urlpatterns = [
    path("", campaign_views.index, name="index"),
    path("healthz", campaign_views.healthz, name="healthz"),
    path("api/shards/<str:sha256>", campaign_views.shard, name="shard"),
    path("api/campaigns/<int:campaign_id>/progress", campaign_views.progress, name="campaign-progress"),
    path("admin/", admin.site.urls),
]
