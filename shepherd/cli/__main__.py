"""``python -m shepherd.cli``."""

import sys

from shepherd.cli.main import main

sys.exit(main())
