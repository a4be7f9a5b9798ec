"""``python -m asyncckpt``: the same as the ``asyncckpt`` command."""

import sys

from .cli import main

sys.exit(main())
