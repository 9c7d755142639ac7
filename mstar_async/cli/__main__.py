"""``python -m mstar_async.cli``: the ``mstar`` command without its console script."""

from __future__ import annotations

import sys

from mstar_async.cli.main import main

sys.exit(main())
