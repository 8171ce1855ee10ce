"""Errors jaxpipe raises for configurations it cannot run."""


class ConfigError(ValueError):
    """A bad configuration; the message says which value, why, and what would work."""
