"""Results JSON -> the report: tables, figures, the claims ledger, metrics.json and LaTeX macros (docs/report.md)."""
import sys

from .claims import *
from .data_stats import *
from .figures import *
from .metrics import *
from .paper import *
from .render import *
from .rows import *
from .stats import *
from .studies.axes import *
from .studies.controls import *
from .studies.exhibits import *
from .studies.frozen import *
from .studies.headline import *
from .studies.heldout import *
from .studies.ladder import *
from .studies.main_budget import *
from .studies.ttt import *
from .studies.tuning import *
from .style import *

# the functions ``metrics`` and ``style`` shadow their modules here: read the modules from sys.modules
_MODULES = ("rows", "stats", "paper", "style", "render", "figures", "studies.main_budget", "studies.tuning",
            "studies.headline", "studies.axes", "studies.controls", "studies.frozen", "studies.ladder", "claims",
            "studies.heldout", "studies.exhibits", "studies.ttt", "metrics", "data_stats")
__all__ = [name for mod in _MODULES for name in sys.modules[f"{__name__}.{mod}"].__all__]
