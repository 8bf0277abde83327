"""``python -m mapl.cli``: the ``mapl`` command without its script."""
import sys

from . import main

sys.exit(main())
