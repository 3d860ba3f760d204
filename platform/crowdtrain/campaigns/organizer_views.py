"""Organizer pages: list, create, manage and edit campaigns, lifecycle buttons, invite links.

Anonymous visitors are sent to log in; volunteers without the organizer role
get 403 with a way to ask for it; an organizer who opens another's campaign
gets 404, as if it did not exist. Staff see every campaign. The campaign's
own address is the exception: whoever does not manage it is sent to its
public join page when they may see the campaign.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from asgiref.sync import async_to_sync
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from crowdtrain.accounts.models import new_invite_code
from crowdtrain.accounts.users import signed_in_user
from crowdtrain.gateway.outbox import send_outbox
from crowdtrain.ops import campaign_monitor as monitor
from crowdtrain.scheduler.backbone import restore_campaign
from crowdtrain.scheduler.durability import complete_versions

from .browser_checks import browser_verdict, check_for_browsers
from .export import export_context
from .forms import CampaignForm, OrganizerRequestForm
from .lifecycle import LOCK_REASON, MOVES, LifecycleError, apply_move, available_moves, config_locked
from .models import Campaign
from .organizers import is_organizer, managed_campaigns, pending_request
from .visibility import can_watch

View = Callable[..., HttpResponse]


def organizer_required(view: View) -> View:
    """Log-in first, then the organizer role; without it a 403 page offers to request the role."""

    @wraps(view)
    @login_required
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not is_organizer(request.user):
            context = {"form": OrganizerRequestForm(), "pending": pending_request(request.user)}
            return render(request, "campaigns/organizer_needed.html", context, status=403)
        return view(request, *args, **kwargs)

    return wrapper


def _managed(request: HttpRequest, campaign_id: int) -> Campaign:
    # Another organizer's campaign is a 404, not a 403: its existence is not theirs to know.
    return get_object_or_404(managed_campaigns(request.user), pk=campaign_id)


@organizer_required
@require_GET
def campaign_list(request: HttpRequest) -> HttpResponse:
    show_archived = request.GET.get("archived") == "1"
    campaigns = managed_campaigns(request.user).order_by("-created_at", "-id")
    if not show_archived:
        campaigns = campaigns.exclude(state=Campaign.State.ARCHIVED)
    return render(request, "campaigns/list.html", {"campaigns": campaigns, "show_archived": show_archived})


@organizer_required
@require_http_methods(["GET", "POST"])
def campaign_create(request: HttpRequest) -> HttpResponse:
    form = CampaignForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        campaign = form.save()
        check_for_browsers(campaign)  # its model, for browser tabs: ready by the time it starts
        messages.success(request, f"Campaign “{campaign.name}” created as a draft. Start it when you are ready.")
        return redirect("campaign-detail", campaign_id=campaign.pk)
    return render(request, "campaigns/form.html", {"form": form, "campaign": None})


@organizer_required
@require_http_methods(["GET", "POST"])
def campaign_edit(request: HttpRequest, campaign_id: int) -> HttpResponse:
    campaign = _managed(request, campaign_id)
    form = CampaignForm(request.POST or None, user=request.user, instance=campaign)
    if request.method == "POST" and form.is_valid():
        form.save()
        check_for_browsers(campaign)  # a changed model or microbatch is another graph
        # Every site process re-reads the campaign: a setting that may change while it runs
        # (check_fraction, max_steps, ...) takes effect at the next lease, not at a restart.
        from crowdtrain.scheduler.configs import publish_state

        publish_state(campaign.pk)
        messages.success(request, f"Campaign “{campaign.name}” saved.")
        return redirect("campaign-detail", campaign_id=campaign.pk)
    return render(request, "campaigns/form.html", {"form": form, "campaign": campaign})


@require_GET
def campaign_detail(request: HttpRequest, campaign_id: int) -> HttpResponse:
    # A guessed or shared address of a campaign one does not manage leads to its public page, where
    # anyone who may see the campaign can join it; one that is not theirs to see stays a 404.
    campaign = managed_campaigns(request.user).filter(pk=campaign_id).first() if is_organizer(request.user) else None
    if campaign is None:
        public = Campaign.objects.filter(pk=campaign_id).exclude(state=Campaign.State.DRAFT).first()
        if public is not None and can_watch(request.user, public):
            return redirect("campaign-join", campaign_id=public.pk)
        if not request.user.is_authenticated:  # it may be theirs once they log in
            return redirect_to_login(request.get_full_path())
        raise Http404(f"no campaign {campaign_id}")
    browser = browser_verdict(campaign)
    if browser.status == "pending" and campaign.state != Campaign.State.DRAFT:
        # Started before graphs were checked, or its worker died: queued again only then (``request_check``).
        check_for_browsers(campaign)
    context = {
        "campaign": campaign,
        "browser": browser,
        "live": monitor.snapshot(campaign),
        "moves": available_moves(campaign),
        "locked": config_locked(campaign),
        "lock_reason": LOCK_REASON,
        "invite_url": (
            request.build_absolute_uri(reverse("campaign-invite", args=[campaign.invite_code]))
            if campaign.visibility == Campaign.Visibility.INVITE and campaign.invite_code
            else None
        ),
        "invited_count": campaign.invited.count(),
        "export": export_context(campaign, request),
        "complete_versions": complete_versions(campaign) if campaign.blocked_reason else [],
    }
    return render(request, "campaigns/detail.html", context)


@staff_member_required
@require_POST
def campaign_restore(request: HttpRequest, campaign_id: int) -> HttpResponse:
    """Staff unblock a campaign whose slice lost its state (``manage.py restore_campaign`` does the same)."""
    campaign = get_object_or_404(Campaign, pk=campaign_id)
    try:
        version = int(request.POST.get("version", ""))
        outbox = restore_campaign(campaign.pk, version)
    except ValueError as exc:
        messages.error(request, f"Nothing changed: {exc}." if str(exc) else "Nothing changed: choose a version.")
    else:
        async_to_sync(send_outbox)(outbox)
        messages.success(
            request, f"Campaign “{campaign.name}” restored to version {version}; its aggregators reload it."
        )
    return redirect("campaign-detail", campaign_id=campaign.pk)


@require_GET
def campaign_monitor(request: HttpRequest, campaign_id: int) -> JsonResponse:
    """The organizer page's live feed (``monitor.snapshot``): for whoever manages the campaign."""
    campaign = managed_campaigns(request.user).filter(pk=campaign_id).first() if is_organizer(request.user) else None
    if campaign is None:  # the same answer for "not yours" and "no such campaign": nothing leaks
        return JsonResponse({"error": f"no campaign {campaign_id} that you manage"}, status=404)
    return JsonResponse(monitor.snapshot(campaign))


@organizer_required
@require_POST
def campaign_lifecycle(request: HttpRequest, campaign_id: int) -> HttpResponse:
    campaign = _managed(request, campaign_id)
    action = request.POST.get("action", "")
    move = MOVES.get(action)
    if move is not None and move.confirm and campaign.state in move.sources and request.POST.get("confirmed") != "yes":
        # A move that cannot be undone asks first, on a page of its own: it works without scripts,
        # and a stray click or a resubmitted form cannot finish a campaign.
        return render(request, "campaigns/confirm_move.html", {"campaign": campaign, "action": action, "move": move})
    try:
        apply_move(campaign.pk, action, request.user)
    except LifecycleError as exc:
        messages.error(request, f"Nothing changed: {exc}.")
    else:
        messages.success(request, f"Campaign “{campaign.name}” {MOVES[action].done}.")
    return redirect("campaign-detail", campaign_id=campaign.pk)


@organizer_required
@require_POST
def campaign_rotate_invite(request: HttpRequest, campaign_id: int) -> HttpResponse:
    campaign = _managed(request, campaign_id)
    if campaign.visibility != Campaign.Visibility.INVITE:
        messages.error(request, "This campaign is public: it has no invite link. Make it invite-only first.")
    else:
        campaign.invite_code = new_invite_code()
        campaign.save(update_fields=["invite_code"])
        messages.success(
            request, "New invite link made. The old link no longer works; volunteers already invited stay."
        )
    return redirect("campaign-detail", campaign_id=campaign.pk)


@login_required
@require_http_methods(["GET", "POST"])
def campaign_invite(request: HttpRequest, code: str) -> HttpResponse:
    # GET only shows the campaign; the button POSTs, so link previews cannot accept for anyone.
    campaign = (
        Campaign.objects.filter(invite_code=code, visibility=Campaign.Visibility.INVITE)
        .exclude(invite_code="")
        .exclude(state=Campaign.State.ARCHIVED)
        .first()
    )
    if not code or campaign is None:
        return render(request, "campaigns/invite_invalid.html", status=404)
    user = signed_in_user(request)
    already = campaign.invited.filter(pk=user.pk).exists()
    if request.method == "POST":
        campaign.invited.add(user)
        if campaign.state == Campaign.State.DRAFT:  # the join page opens when the campaign starts
            messages.success(request, f"You are invited to “{campaign.name}”. It has not started yet; come back soon.")
            return redirect("index")
        messages.success(request, f"You are invited to “{campaign.name}”. Start an agent for it below.")
        return redirect("campaign-join", campaign_id=campaign.pk)
    return render(request, "campaigns/invite.html", {"campaign": campaign, "already": already})
