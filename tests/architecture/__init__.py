"""The package's import graph."""
