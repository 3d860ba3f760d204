from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from crowdtrain.accounts import profile_views, team_views
from crowdtrain.campaigns import join as campaign_join
from crowdtrain.campaigns import views as campaign_views

urlpatterns = [
    path("", campaign_views.index, name="index"),
    path("healthz", campaign_views.healthz, name="healthz"),
    path("api/shards/<str:sha256>", campaign_views.shard, name="shard"),
    path("api/campaigns/<int:campaign_id>/progress", campaign_views.progress, name="campaign-progress"),
    path("admin/", admin.site.urls),
    path("campaigns/<int:campaign_id>/join", campaign_join.join, name="campaign-join"),
    # Agents log in with a device code; volunteers approve it and manage their devices.
    path("", include("crowdtrain.accounts.device_urls")),
    # Volunteers: sign-up, e-mail verification, log-in and password reset are allauth's.
    path("accounts/", include("allauth.urls")),
    path("me/", profile_views.profile, name="profile"),
    path("teams/", team_views.my_team, name="my-team"),
    path("teams/new", team_views.team_create, name="team-create"),
    path("teams/join/<str:code>", team_views.team_join, name="team-join"),
    path("teams/<slug:slug>/", team_views.team_detail, name="team"),
    path("teams/<slug:slug>/leave", team_views.team_leave, name="team-leave"),
    path("teams/<slug:slug>/invite", team_views.team_rotate_invite, name="team-rotate-invite"),
]
