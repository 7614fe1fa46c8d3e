"""``python -m perseus_emulation.job``: see :mod:`perseus_emulation.job.cli`."""

import sys

from perseus_emulation.job.cli import main

sys.exit(main())
