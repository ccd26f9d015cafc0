"""Comparing KV policies: shipped data sets, bench cells (free generation + teacher-forced fidelity), matched
budgets, metrics with intervals, the record log, provenance, plots and KV-Rescue cells. No typer/rich import.
"""
