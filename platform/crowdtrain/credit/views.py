"""Leaderboards (a page, and a JSON feed the page polls to move live), a volunteer's own credit, the stats export."""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.files.storage import default_storage
from django.core.paginator import Paginator
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET

from crowdtrain.accounts.models import ANONYMOUS_NAME, Profile, Team
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.visibility import can_watch

from . import boards
from .export import NOT_YET, STATS_NAME
from .models import FORMULA

PAGE_SIZE = 50


class BoardQuery(forms.Form):
    """A board's address: its scope, subjects, period and page; anything else is a 400 that names the field."""

    of = forms.ChoiceField(choices=[(s, s) for s in boards.SUBJECTS], required=False)
    period = forms.ChoiceField(choices=list(boards.PERIODS.items()), required=False)
    campaign = forms.IntegerField(min_value=1, max_value=2**31 - 1, required=False)
    page = forms.IntegerField(min_value=1, max_value=10**6, required=False)
    me = forms.BooleanField(required=False)


def _query(request: HttpRequest) -> tuple[dict[str, Any], str | None]:
    form = BoardQuery(request.GET)
    if not form.is_valid():
        problems = "; ".join(f"{field}: {' '.join(str(e) for e in errors)}" for field, errors in form.errors.items())
        return {}, f"bad leaderboard address ({problems})"
    data = form.cleaned_data
    campaign = None
    if data["campaign"] is not None:
        campaign = Campaign.objects.filter(pk=data["campaign"]).first()
        if campaign is None or not can_watch(request.user, campaign):  # the same answer for both: nothing leaks
            return {}, f"campaign: no campaign {data['campaign']}"
    return {
        "of": data["of"] or "volunteers",
        "period": data["period"] or "7d",
        "campaign": campaign,
        "page": data["page"] or 1,
        "me": data["me"],
    }, None


def _viewer_id(request: HttpRequest, subject: str) -> int | None:
    user = request.user
    if not user.is_authenticated:
        return None
    if subject == "volunteers":
        return int(user.pk)
    return Profile.objects.filter(user=user).values_list("team_id", flat=True).first()


def _board(request: HttpRequest, q: dict[str, Any]) -> dict[str, Any]:
    scope = q["campaign"].pk if q["campaign"] else boards.EVERY_CAMPAIGN
    viewer = _viewer_id(request, q["of"])
    mine = boards.standing(scope, q["of"], q["period"], viewer) if viewer is not None else None
    page = q["page"]
    if q["me"] and mine is not None:
        page = (mine.rank - 1) // PAGE_SIZE + 1
    rows, total = boards.page(scope, q["of"], q["period"], (page - 1) * PAGE_SIZE, PAGE_SIZE)
    names = _names(q["of"], [r.subject_id for r in rows] + ([mine.subject_id] if mine else []))
    pages = max(1, -(-total // PAGE_SIZE))

    def row(r: boards.Row) -> dict[str, Any]:
        name, url = names.get(r.subject_id, (ANONYMOUS_NAME, ""))
        return {"rank": r.rank, "name": name, "url": url, "credit": round(r.credit, 3), "me": r.subject_id == viewer}

    return {
        "rows": [row(r) for r in rows],
        "total": total,
        "page": page,
        "pages": pages,
        "me": row(mine) if mine else None,
        "me_on_page": mine is not None and any(r.subject_id == mine.subject_id for r in rows),
    }


def _names(subject: str, ids: list[int]) -> dict[int, tuple[str, str]]:
    """Public names only: a volunteer's display name or "Anonymous", never an e-mail address."""
    if subject == "teams":
        return {t.pk: (t.name, t.get_absolute_url()) for t in Team.objects.filter(pk__in=ids).only("name", "slug")}
    return {p.user_id: (p.public_name, "") for p in Profile.objects.filter(user_id__in=ids)}


@require_GET
def leaderboard(request: HttpRequest) -> HttpResponse:
    q, problem = _query(request)
    if problem:
        return render(request, "credit/bad_query.html", {"problem": problem}, status=400)
    board = _board(request, q)
    campaigns = Campaign.objects.exclude(state=Campaign.State.DRAFT).filter(visibility=Campaign.Visibility.PUBLIC)
    return render(
        request,
        "credit/leaderboard.html",
        {
            "q": q,
            "board": board,
            "periods": boards.PERIODS,
            "period_label": boards.PERIODS[q["period"]],
            "subjects": boards.SUBJECTS,
            "campaigns": campaigns.order_by("-id").only("name")[:100],
            "page_numbers": Paginator(range(board["total"] or 1), PAGE_SIZE).get_elided_page_range(board["page"]),
            "formula": FORMULA,
            "feed_url": reverse("leaderboard-feed"),
        },
    )


@require_GET
def leaderboard_feed(request: HttpRequest) -> JsonResponse:
    q, problem = _query(request)
    if problem:
        return JsonResponse({"error": problem}, status=400)
    return JsonResponse(_board(request, q))


@require_GET
def stats_json(request: HttpRequest) -> FileResponse | JsonResponse:
    # Streamed from storage (local or S3), like a campaign's weights: the file can be large.
    try:
        stored = default_storage.open(STATS_NAME, "rb")
    except FileNotFoundError:
        return JsonResponse({"error": NOT_YET}, status=404)
    response = FileResponse(stored, content_type="application/json")
    response["Cache-Control"] = "public, max-age=3600"
    return response
