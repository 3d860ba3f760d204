"""The scheduler's hot state moved to Redis: its tables for returned ranges and participations go,
leases remember their epoch, and lease ids come in blocks."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("accounts", "0002_profiles_teams_device_codes"),
        ("campaigns", "0006_campaign_hot_key"),
        ("scheduler", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="IdBlock",
            fields=[
                ("name", models.CharField(max_length=32, primary_key=True, serialize=False)),
                ("next_id", models.BigIntegerField()),
            ],
        ),
        migrations.DeleteModel(name="Participation"),
        migrations.DeleteModel(name="ReturnedRange"),
        migrations.AddField(model_name="lease", name="epoch", field=models.PositiveIntegerField(default=0)),
        migrations.AddIndex(
            model_name="lease",
            index=models.Index(fields=["campaign", "epoch"], name="scheduler_l_campaig_5d1456_idx"),
        ),
    ]
