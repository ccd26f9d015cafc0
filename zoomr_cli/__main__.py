"""``python -m zoomr``: the command line."""

from zoomr.cli.app import run

run()
