"""A volunteer's own standing: what verification says of them and, in quarantine, why and how to appeal."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from crowdtrain.accounts.users import signed_in_user

from .forms import AppealForm
from .models import Standing


@login_required
@require_http_methods(["GET", "POST"])
def standing_page(request: HttpRequest) -> HttpResponse:
    user = signed_in_user(request)
    # No row yet means no check has been decided: the volunteer is in good standing (nothing is written on a GET).
    row = Standing.objects.filter(volunteer=user).first() or Standing(volunteer=user)
    quarantined = row.state == Standing.State.QUARANTINED
    form = AppealForm(request.POST or None, initial={"appeal": row.current_appeal})
    if request.method == "POST":
        if not quarantined:
            messages.error(request, f"Only a quarantined account can appeal; yours is {row.get_state_display()}.")
            return redirect("standing")
        if form.is_valid():
            # Filtered on the state: an admin's decision taken while the volunteer wrote is not overwritten.
            saved = Standing.objects.filter(volunteer=user, state=Standing.State.QUARANTINED).update(
                appeal=form.cleaned_data["appeal"], appealed_at=timezone.now()
            )
            if saved:
                messages.success(
                    request, "Appeal sent. An admin reads it before deciding; this page shows the outcome."
                )
            else:
                messages.error(request, "Your account left quarantine while you wrote; the appeal was not needed.")
            return redirect("standing")
    context = {"standing": row, "quarantined": quarantined, "form": form}
    return render(request, "verification/standing.html", context)
