"""``python -m mapl.cli``: the ``mapl`` command without its script (the tests, and a checkout whose code must
run rather than the installed one's: ``python -m`` puts the working folder first on the import path)."""
import sys

from . import main

sys.exit(main())
