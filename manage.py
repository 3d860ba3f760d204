#!/usr/bin/env python3
"""Django's command-line utility for the Crowdtrain site.

    ./manage.py migrate
    ./manage.py runserver
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# platform/ is a plain folder (a package named `platform` would shadow the
# standard library), so its packages and the agent's are put on the path here.
for folder in (ROOT / "platform", ROOT / "agent" / "src"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crowdtrain.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
