"""``python -m tidelog ...``: the same as the ``tidelog`` command."""

import sys

from tidelog.cli import main

sys.exit(main())
