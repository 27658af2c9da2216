"""``python -m moelora_conformance``: the ``moelora-conformance`` command line."""

import sys

from moelora_conformance.cli import main

sys.exit(main())
