# Written by hand for part B (validation loss and export) while other parts' model changes are in flight;
# the lead regenerates migrations at the end.

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("campaigns", "0003_organizers_group"),
    ]

    operations = [
        migrations.AddField(
            model_name="campaign",
            name="validate_every",
            field=models.PositiveIntegerField(default=10, help_text="steps between validation losses; 0 disables"),
        ),
        migrations.CreateModel(
            name="ValidationResult",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("version", models.PositiveIntegerField()),
                ("loss", models.FloatField(blank=True, help_text="empty when the dataset has no held-out split", null=True)),
                ("num_samples", models.PositiveIntegerField()),
                ("weights", models.CharField(blank=True, max_length=255)),
                ("computed_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "campaign",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="validation_results",
                        to="campaigns.campaign",
                    ),
                ),
            ],
            options={
                "ordering": ["campaign", "version"],
                "constraints": [
                    models.UniqueConstraint(fields=("campaign", "version"), name="unique_validation_version")
                ],
            },
        ),
    ]
