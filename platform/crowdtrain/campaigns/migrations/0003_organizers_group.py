"""The "organizers" group: its members create and run campaigns."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def create_group(apps: Any, schema_editor: Any) -> None:
    apps.get_model("auth", "Group").objects.get_or_create(name="organizers")


def delete_group(apps: Any, schema_editor: Any) -> None:
    apps.get_model("auth", "Group").objects.filter(name="organizers").delete()


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("campaigns", "0002_organizers"),
    ]

    operations = [migrations.RunPython(create_group, delete_group)]
