"""The package version (one place: the package, its actor files and result files read it)."""

__version__ = "0.1.0"
