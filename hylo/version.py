"""hylo's version (read by the packaging metadata and written into ``run.json``)."""

__version__ = "0.1.0"
