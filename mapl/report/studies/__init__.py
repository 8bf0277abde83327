"""The studies' tables and figures, one module per study (the report notebook shows them in order)."""
