"""The admins' review queue: quarantined volunteers, their appeals and failures, and the Clear and Ban buttons."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth import get_user_model
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from crowdtrain.accounts.access import staff_required
from crowdtrain.accounts.models import Profile

from . import quarantine, review
from .forms import BanForm
from .models import Standing


def _who(volunteer_id: int) -> str:
    """How a success message names a volunteer: their public name and, for the admin, their e-mail."""
    user = get_object_or_404(get_user_model(), pk=volunteer_id)
    name = Profile.of(user).public_name
    return f"{name} ({user.email})" if user.email else name


@staff_required
@require_GET
def review_queue(request: HttpRequest) -> HttpResponse:
    context = {
        "queue": review.quarantined(),
        "banned": review.recently_banned(),
        "ban_form": BanForm(),
        "recent_failures": review.RECENT_FAILURES,
    }
    return render(request, "verification/review_queue.html", context)


@staff_required
@require_POST
def review_clear(request: HttpRequest, volunteer_id: int) -> HttpResponse:
    who = _who(volunteer_id)
    if quarantine.clear(volunteer_id, request.user.pk):
        messages.success(request, f"Cleared {who}: their work counts again and their credit is given back.")
    else:
        messages.error(request, f"Nothing changed: {who} is not in quarantine (another admin may have decided).")
    return redirect("review-queue")


@staff_required
@require_POST
def review_ban(request: HttpRequest, volunteer_id: int) -> HttpResponse:
    who = _who(volunteer_id)
    form = BanForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"{who} was not banned. {' '.join(str(e) for e in form.errors['reason'])}")
        return redirect("review-queue")
    state = Standing.objects.filter(volunteer_id=volunteer_id).values_list("state", flat=True).first()
    if state != Standing.State.QUARANTINED:
        # The queue only bans from quarantine; a decision another admin took meanwhile stands.
        messages.error(request, f"Nothing changed: {who} is not in quarantine (another admin may have decided).")
        return redirect("review-queue")
    reason = form.cleaned_data["reason"].strip() or "banned after review"
    if quarantine.ban(volunteer_id, request.user.pk, reason):
        messages.success(request, f"Banned {who}: their devices are revoked and their credit stays taken back.")
    else:
        messages.error(request, f"Nothing changed: {who} is banned already.")
    return redirect("review-queue")
