"""The forms of the verification pages: a quarantined volunteer's appeal, and an admin's reason for a ban."""

from __future__ import annotations

from django import forms

from .models import Standing

APPEAL_MIN = 10
APPEAL_MAX = 2000
# Standing.reason's length: a longer reason would be cut short silently by quarantine.ban.
BAN_REASON_MAX = Standing._meta.get_field("reason").max_length or 500


class AppealForm(forms.Form):
    # Django's defaults ("Ensure this value has at least 10 characters") do not name the field.
    appeal = forms.CharField(
        label="Your appeal",
        min_length=APPEAL_MIN,
        max_length=APPEAL_MAX,
        widget=forms.Textarea(attrs={"rows": 6}),
        help_text=(
            f"Tell the admins what they should know: your GPU and drivers, changes to your setup, anything unusual. "
            f"{APPEAL_MIN} to {APPEAL_MAX} characters; a new appeal replaces the last one."
        ),
        error_messages={
            "required": "Your appeal is empty: write what the admins should know before they decide.",
            "min_length": "Your appeal needs at least %(limit_value)d characters (it has %(show_value)d).",
            "max_length": "Your appeal must be at most %(limit_value)d characters (it has %(show_value)d); shorten it.",
        },
    )


class BanForm(forms.Form):
    reason = forms.CharField(
        label="Ban reason",
        required=False,
        max_length=BAN_REASON_MAX,
        error_messages={
            "max_length": "Ban reason must be at most %(limit_value)d characters (it has %(show_value)d); shorten it.",
        },
    )
