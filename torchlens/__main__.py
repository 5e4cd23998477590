"""``python -m torchlens``: the same program as the ``torchlens`` command."""

import sys

from .cli import main

__all__: list[str] = []

sys.exit(main())
