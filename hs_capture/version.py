"""The package version, a leaf: the server side reads it without importing the package root
(whose lazy exports reach the offline datasets)."""

__version__ = "0.2.0"
