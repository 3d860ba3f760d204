from __future__ import annotations

from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from crowdtrain.accounts import profile_views, team_views
from crowdtrain.campaigns import export_views, join_views, organizer_views, role_views, tab_views
from crowdtrain.campaigns import views as campaign_views
from crowdtrain.credit import views as credit_views
from crowdtrain.datasets import dataset_views, pretrained_views, upload_views
from crowdtrain.ops import views as ops_views
from crowdtrain.verification import review_views, standing_views

urlpatterns = [
    # Browsers and tools ask for /favicon.ico whatever the page links: the site's icon, not a 404 in every log.
    path("favicon.ico", RedirectView.as_view(url=static("img/favicon.svg"), permanent=True)),
    path("", campaign_views.index, name="index"),
    # Balancers check /livez (the process answers); monitors /healthz (alerts); Prometheus scrapes /metrics.
    path("livez", ops_views.livez, name="livez"),
    path("healthz", ops_views.healthz, name="healthz"),
    path("metrics", ops_views.metrics, name="metrics"),
    # The admins' live dashboard: the page; its snapshots come over /ws/dashboard/ (gateway.dashboard).
    path("dashboard/", ops_views.dashboard, name="ops-dashboard"),
    path("api/shards/<str:sha256>", campaign_views.shard, name="shard"),
    path("api/campaigns/<int:campaign_id>/progress", campaign_views.progress, name="campaign-progress"),
    path("api/campaigns/<int:campaign_id>/monitor", organizer_views.campaign_monitor, name="campaign-monitor"),
    path("api/campaigns/<int:campaign_id>/coverage", campaign_views.coverage, name="campaign-coverage"),
    path("admin/", admin.site.urls),
    # Browser tabs: a campaign's verdict and gradient graphs, and a graph's ONNX bytes (crowdtrain.browser).
    path("", include("crowdtrain.browser.urls")),
    path("campaigns/<int:campaign_id>/join", join_views.join, name="campaign-join"),
    # A volunteer's browser tab as a device: the page and its worker (issue 36).
    path("campaigns/<int:campaign_id>/tab/", tab_views.tab, name="campaign-tab"),
    # The agent the join pages install: crowdtrain_agent-<version>-py3-none-any.whl (manage.py build_agent_wheel).
    path("agent/<str:filename>", join_views.agent_wheel, name="agent-wheel"),
    # Organizers: their campaigns, the form, lifecycle buttons, invite links; the role and its requests.
    path("campaigns/", organizer_views.campaign_list, name="campaign-list"),
    path("campaigns/new", organizer_views.campaign_create, name="campaign-create"),
    path("campaigns/<int:campaign_id>/", organizer_views.campaign_detail, name="campaign-detail"),
    path("campaigns/<int:campaign_id>/edit", organizer_views.campaign_edit, name="campaign-edit"),
    path("campaigns/<int:campaign_id>/lifecycle", organizer_views.campaign_lifecycle, name="campaign-lifecycle"),
    path("campaigns/<int:campaign_id>/invite", organizer_views.campaign_rotate_invite, name="campaign-rotate-invite"),
    path("campaigns/<int:campaign_id>/restore", organizer_views.campaign_restore, name="campaign-restore"),
    path("campaigns/invite/<str:code>", organizer_views.campaign_invite, name="campaign-invite"),
    # The trained model of a validated version: safetensors weights and the config load_exported reads.
    path("campaigns/<int:campaign_id>/export", export_views.campaign_export, name="campaign-export"),
    path(
        "campaigns/<int:campaign_id>/export/config.json",
        export_views.campaign_export_config,
        name="campaign-export-config",
    ),
    # The same version as a transformers folder (zipped): config.json, model.safetensors, a tokenizer.
    path(
        "campaigns/<int:campaign_id>/export/transformers.zip",
        export_views.campaign_export_transformers,
        name="campaign-export-transformers",
    ),
    path("organizers/request", role_views.organizer_request, name="organizer-request"),
    path("organizers/requests", role_views.organizer_requests, name="organizer-requests"),
    path("organizers/requests/<int:request_id>/decide", role_views.organizer_decide, name="organizer-decide"),
    # Organizers' datasets: a resumable chunked upload API, the uploader page, sharding progress.
    path("datasets/", dataset_views.dataset_list, name="dataset-list"),
    path("datasets/new", dataset_views.dataset_upload_page, name="dataset-upload"),
    path("datasets/<int:dataset_id>/", dataset_views.dataset_detail, name="dataset-detail"),
    path("datasets/<int:dataset_id>/status", dataset_views.dataset_status, name="dataset-status"),
    path("models/new", pretrained_views.pretrained_upload_page, name="pretrained-upload"),
    path("models/<int:pretrained_id>/", pretrained_views.pretrained_detail, name="pretrained-detail"),
    path("models/<int:pretrained_id>/status", pretrained_views.pretrained_status, name="pretrained-status"),
    path("api/backbone/weights/<str:sha256>", campaign_views.initial_weights, name="backbone-weights"),
    path("datasets/uploads", upload_views.upload_create, name="dataset-upload-create"),
    path("datasets/tokenizers", upload_views.tokenizer_upload, name="dataset-tokenizer-upload"),
    path("datasets/uploads/<uuid:upload_id>", upload_views.upload_status, name="dataset-upload-status"),
    path("datasets/uploads/<uuid:upload_id>/chunk", upload_views.upload_chunk, name="dataset-upload-chunk"),
    path("datasets/uploads/<uuid:upload_id>/complete", upload_views.upload_complete, name="dataset-upload-complete"),
    # Agents log in with a device code; volunteers approve it and manage their devices.
    path("", include("crowdtrain.devices.urls")),
    # Volunteers: sign-up, e-mail verification, log-in and password reset are allauth's.
    path("accounts/", include("allauth.urls")),
    path("me/", profile_views.profile, name="profile"),
    # Verification: a volunteer's standing and appeal; the admins' queue of quarantined volunteers.
    path("account/standing/", standing_views.standing_page, name="standing"),
    path("staff/review/", review_views.review_queue, name="review-queue"),
    path("staff/review/<int:volunteer_id>/clear", review_views.review_clear, name="review-clear"),
    path("staff/review/<int:volunteer_id>/ban", review_views.review_ban, name="review-ban"),
    path("leaderboards/", credit_views.leaderboard, name="leaderboard"),
    path("api/leaderboards", credit_views.leaderboard_feed, name="leaderboard-feed"),
    # Every volunteer's and team's credit, rewritten daily, for third-party stats sites (as BOINC projects publish).
    path("stats/stats.json", credit_views.stats_json, name="stats-json"),
    path("teams/", team_views.my_team, name="my-team"),
    path("teams/new", team_views.team_create, name="team-create"),
    path("teams/join/<str:code>", team_views.team_join, name="team-join"),
    path("teams/<slug:slug>/", team_views.team_detail, name="team"),
    path("teams/<slug:slug>/leave", team_views.team_leave, name="team-leave"),
    path("teams/<slug:slug>/invite", team_views.team_rotate_invite, name="team-rotate-invite"),
]
