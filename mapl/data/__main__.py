"""``python -m mapl.data``: see :mod:`mapl.data.cli`."""
from .cli import main

raise SystemExit(main())
