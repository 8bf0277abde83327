"""Shared test harnesses: synthetic results for the report, the prose check of the documents."""
