"""The package's version: the single source, which the build backend
(_build/tensorrpc_build.py) reads for the wheel's metadata."""

__version__ = "0.1.0"
