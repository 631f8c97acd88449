"""Command-line entry points (``edgefuse ...``); the library never imports this package."""
