"""``python -m lightning_memkit.cli``: the ``memkit`` command."""

import sys

from lightning_memkit.cli import main

sys.exit(main())
