"""The command line (Typer + rich): each command parses its options, calls the library, renders the result.

Nothing below :mod:`zoomr.cli` imports it; domain code lives in :mod:`zoomr.rescue`, :mod:`zoomr.evaluation`,
:mod:`zoomr.backends` and :mod:`zoomr.kvstore`.
"""
