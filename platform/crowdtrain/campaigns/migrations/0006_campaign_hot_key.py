import uuid

from django.db import migrations, models


def give_each_campaign_its_own_key(apps, schema_editor) -> None:  # noqa: ANN001
    # AddField evaluated the default once: every existing campaign got the same key.
    Campaign = apps.get_model("campaigns", "Campaign")
    for campaign in Campaign.objects.all().only("pk"):
        Campaign.objects.filter(pk=campaign.pk).update(hot_key=uuid.uuid4())


class Migration(migrations.Migration):

    dependencies = [
        ("campaigns", "0005_uploads"),
    ]

    operations = [
        migrations.AddField(
            model_name="campaign",
            name="hot_key",
            field=models.UUIDField(default=uuid.uuid4, editable=False),
        ),
        migrations.RunPython(give_each_campaign_its_own_key, migrations.RunPython.noop),
    ]
