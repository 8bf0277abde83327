"""Results JSON -> the report: tables (Markdown, CSV, LaTeX), figures, the claims ledger, metrics.json and LaTeX
macros; each table and figure with a caption and a takeaway computed from its numbers. The logic behind
``notebooks/report.ipynb``::

    >>> from mapl import report
    >>> paths = report.output_paths(ROOT, "cpu")                    # reports/cpu/{results,tables,...}
    >>> rows = report.select(report.load_results(ROOT, paths["results"]), profile="cpu")
    >>> report.show(report.headline_table(rows), paths["tables"])

The core: :mod:`~mapl.report.rows` (results -> rows), :mod:`~mapl.report.stats`, :mod:`~mapl.report.paper` (the
paper's numbers), :mod:`~mapl.report.style` (the one palette), :mod:`~mapl.report.render` (tables and figures as
files), :mod:`~mapl.report.figures` (drawing), :mod:`~mapl.report.claims` (the ledger) and
:mod:`~mapl.report.metrics`; each study's tables and figures are a module of :mod:`mapl.report.studies`.

Two ratios, never confused: ``wire_ratio`` = 2d / forward bytes per token and ``projection_ratio`` = d / r; MAPL+VQ
at projection 8x is 16x on the wire. Every table says which it shows.
"""
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
