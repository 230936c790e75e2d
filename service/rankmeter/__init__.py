"""rankmeter: streaming online evaluation for search."""

__version__ = "0.1.0"
