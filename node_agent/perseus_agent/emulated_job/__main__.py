"""``python -m perseus_agent.emulated_job``: see :mod:`perseus_agent.emulated_job.cli`."""

import sys

from perseus_agent.emulated_job.cli import main

sys.exit(main())
