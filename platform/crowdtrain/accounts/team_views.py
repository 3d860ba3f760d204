"""Team pages: create, show, join through an invite link, leave, rotate the link.

GET never changes membership: the join link shows a confirmation page whose
button POSTs, so link previews, prefetchers and crawlers cannot add anyone.
"""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from crowdtrain.credit import charts, summaries
from crowdtrain.credit.models import FORMULA

from .models import Profile, Team
from .teams import AlreadyInTeam, create_team, join_team, leave_team, team_for_invite


class TeamForm(forms.ModelForm):
    class Meta:
        model = Team
        fields = ["name", "description"]
        help_texts = {
            "name": "Shown on leaderboards. Letters, digits, spaces, dots, dashes and apostrophes.",
            "description": "Optional: who you are and what you train for.",
        }
        widgets = {"description": forms.Textarea(attrs={"rows": 4})}

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        if Team.objects.filter(name__iexact=name).exists():
            raise forms.ValidationError(f"A team called “{name}” already exists; choose another name.")
        return name


@login_required
@require_GET
def my_team(request: HttpRequest) -> HttpResponse:
    team = Profile.of(request.user).team
    if team is not None:
        return redirect(team)
    return render(request, "teams/none.html")


@login_required
@require_http_methods(["GET", "POST"])
def team_create(request: HttpRequest) -> HttpResponse:
    current = Profile.of(request.user).team
    form = TeamForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            team = create_team(request.user, form.cleaned_data["name"], form.cleaned_data["description"])
        except AlreadyInTeam as exc:
            form.add_error(None, f"You are a member of “{exc.team.name}”. Leave it before you create a team.")
        except IntegrityError:  # another volunteer took the name between validation and insert
            form.add_error("name", "A team with this name was just created; choose another name.")
        else:
            messages.success(request, f"Team “{team.name}” created. Share the invite link below with your teammates.")
            return redirect(team)
    return render(request, "teams/create.html", {"form": form, "current_team": current})


@require_GET
def team_detail(request: HttpRequest, slug: str) -> HttpResponse:
    team = get_object_or_404(Team, slug=slug)
    members = sorted(team.members.select_related("user"), key=lambda p: (p.anonymous, p.public_name.casefold()))
    is_member = request.user.is_authenticated and any(p.user_id == request.user.pk for p in members)
    credit = summaries.of_team(team.pk)
    shares = {s.volunteer_id: s for s in summaries.shares_of_team(team.pk)}
    current = {p.user_id for p in members}
    # Those who left keep their part of the team's credit; shown together, so the shares still add up.
    former = [s for volunteer, s in shares.items() if volunteer not in current]
    context = {
        "team": team,
        "members": members,
        "member_shares": [(p, shares.get(p.user_id)) for p in members],  # None: no credit in this team yet
        "former_credit": sum(s.credit for s in former),
        "former_percent": sum(s.percent or 0.0 for s in former) if former and credit.credit > 1e-12 else None,
        "former_count": len(former),
        "credit": credit,
        "credit_chart": charts.daily_credit(credit.days),
        "recent_definition": summaries.RECENT_DEFINITION,
        "formula": FORMULA,
        "is_member": is_member,
        "is_creator": is_member and team.created_by_id == request.user.pk,
        # Only members see the link: it is the team's only secret.
        "invite_url": request.build_absolute_uri(reverse("team-join", args=[team.invite_code])) if is_member else None,
    }
    return render(request, "teams/detail.html", context)


@login_required
@require_http_methods(["GET", "POST"])
def team_join(request: HttpRequest, code: str) -> HttpResponse:
    team = team_for_invite(code)
    if team is None:
        return render(request, "teams/invite_invalid.html", status=404)
    current = Profile.of(request.user).team
    if current is not None and current.pk == team.pk:
        messages.info(request, f"You are already a member of “{team.name}”.")
        return redirect(team)
    if request.method == "POST":
        try:
            join_team(request.user, team, leave_current=request.POST.get("leave_current") == "yes")
        except AlreadyInTeam:
            messages.error(request, f"Confirm that you want to leave “{current}” to join “{team.name}”.")
        else:
            messages.success(request, f"Welcome to “{team.name}”.")
            return redirect(team)
    return render(request, "teams/join.html", {"team": team, "current_team": current})


@login_required
@require_POST
def team_leave(request: HttpRequest, slug: str) -> HttpResponse:
    team = get_object_or_404(Team, slug=slug)
    if leave_team(request.user, team):
        messages.success(request, f"You left “{team.name}”.")
    else:
        messages.info(request, f"You are not a member of “{team.name}”.")
    return redirect("my-team")


@login_required
@require_POST
def team_rotate_invite(request: HttpRequest, slug: str) -> HttpResponse:
    team = get_object_or_404(Team, slug=slug)
    if team.created_by_id != request.user.pk or not team.is_member(request.user):
        raise PermissionDenied("only the team's creator, while a member, can replace the invite link")
    team.rotate_invite_code()
    messages.success(request, "New invite link made. The old link no longer works.")
    return redirect(team)
