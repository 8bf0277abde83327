"""``python -m mapl.cli``: the ``mapl`` command without its script (launchers start ranks this way:
``torchrun ... -m mapl.cli pipeline ...``)."""
import sys

from . import main

sys.exit(main())
