"""The volunteer's own profile page: the name public pages show, or anonymity, and their credit."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from crowdtrain.credit import charts, summaries
from crowdtrain.credit.models import FORMULA
from crowdtrain.verification.models import Standing

from .models import ANONYMOUS_NAME, Profile


class ProfileForm(forms.ModelForm):
    class Meta:
        model = Profile
        fields = ["display_name", "anonymous"]
        labels = {"display_name": "Display name", "anonymous": f"Appear as “{ANONYMOUS_NAME}”"}
        help_texts = {
            "display_name": "Shown on leaderboards and team pages. Leave empty to appear as “Volunteer” and a number.",
            "anonymous": "Hide your name on every public page; your work still counts for you and your team.",
        }


@login_required
@require_http_methods(["GET", "POST"])
def profile(request: HttpRequest) -> HttpResponse:
    current = Profile.of(request.user)
    form = ProfileForm(request.POST or None, instance=current)
    if request.method == "POST" and form.is_valid():
        form.save()
        messages.success(request, f"Profile saved. Public pages show you as “{current.public_name}”.")
        return redirect("profile")
    credit = summaries.of_volunteer(current.user_id)
    # No standing row yet: no check of their work has been decided, so they are in good standing.
    state = Standing.objects.filter(volunteer_id=current.user_id).values_list("state", flat=True).first()
    context = {
        "form": form,
        "profile": current,
        "credit": credit,
        "credit_chart": charts.daily_credit(credit.days),
        "recent_definition": summaries.RECENT_DEFINITION,
        "formula": FORMULA,
        "standing": Standing.State(state or Standing.State.GOOD),
    }
    return render(request, "accounts/profile.html", context)
