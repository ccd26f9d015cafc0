"""zoomr: long reasoning under a fixed KV-cache budget, from the command line."""

__version__ = "0.1.0"
