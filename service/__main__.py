"""``python -m service`` is the ``robez`` command."""

import sys

from .cli import main

sys.exit(main())
