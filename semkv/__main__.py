"""``python -m semkv ...`` is the ``semkv`` command."""

import sys

from semkv.cli import main

sys.exit(main())
