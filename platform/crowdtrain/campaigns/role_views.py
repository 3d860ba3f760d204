"""Asking for the organizer role, and the staff page that grants or refuses it."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from crowdtrain.accounts.access import staff_required
from crowdtrain.accounts.users import signed_in_user

from .forms import OrganizerRequestForm
from .models import OrganizerRequest
from .organizer_mail import mail_outcome, mail_staff_about
from .organizers import RoleRequestError, decide, is_organizer, pending_request, request_role


@login_required
@require_http_methods(["GET", "POST"])
def organizer_request(request: HttpRequest) -> HttpResponse:
    user = signed_in_user(request)
    if is_organizer(user):
        messages.info(request, "You already have the organizer role.")
        return redirect("campaign-list")
    form = OrganizerRequestForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        already_pending = pending_request(user) is not None  # asking twice mails nobody twice
        try:
            row = request_role(user, form.cleaned_data["reason"])
        except RoleRequestError as exc:
            form.add_error("reason", f"{str(exc)[0].upper()}{str(exc)[1:]}.")
        else:
            if not already_pending:
                mail_staff_about(row, request.build_absolute_uri(reverse("organizer-requests")))
            messages.success(request, "Request sent. An admin will grant or refuse it; this page shows the answer.")
            return redirect("organizer-request")
    decided = OrganizerRequest.objects.filter(user=user).exclude(decision=OrganizerRequest.Decision.PENDING)
    context = {"form": form, "pending": pending_request(user), "last_decided": decided.first()}
    return render(request, "campaigns/organizer_request.html", context)


@staff_required
@require_GET
def organizer_requests(request: HttpRequest) -> HttpResponse:
    pending = OrganizerRequest.objects.filter(decision=OrganizerRequest.Decision.PENDING).select_related("user")
    recent = (
        OrganizerRequest.objects.exclude(decision=OrganizerRequest.Decision.PENDING)
        .select_related("user", "decided_by")
        .order_by("-decided_at")[:20]
    )
    context = {"pending": pending.order_by("created"), "recent": recent}
    return render(request, "campaigns/organizer_requests.html", context)


@staff_required
@require_POST
def organizer_decide(request: HttpRequest, request_id: int) -> HttpResponse:
    decision = request.POST.get("decision")
    if decision not in {"grant", "refuse"}:
        messages.error(request, f"Unknown decision {decision!r}: use Grant or Refuse.")
        return redirect("organizer-requests")
    try:
        row = decide(request_id, request.user, grant=decision == "grant")
    except RoleRequestError as exc:
        messages.error(request, f"Nothing changed: {exc}.")
    else:
        mail_outcome(row, request.build_absolute_uri("/"))
        who = row.user.email or row.user.get_username()
        messages.success(request, f"{who} is now an organizer." if row.decision == "granted" else f"Refused {who}.")
    return redirect("organizer-requests")
