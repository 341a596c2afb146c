"""Errors a user can cause. The CLI prints them as one line and exits nonzero; anything else is our bug."""


class SpecchatError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""


class ModelNotFoundError(SpecchatError):
    """An unknown alias, or a path that does not exist."""


class ModelFormatError(SpecchatError):
    """A model file that is missing pieces, truncated, of an unsupported architecture or of the wrong shape."""


class OfflineError(SpecchatError):
    """A model is not cached and cannot be fetched."""


class ConfigError(SpecchatError):
    """An invalid parameter (sampling, speculation, engine settings)."""


class PromptError(SpecchatError):
    """An empty prompt, or a prompt that does not fit the context."""


class KVCacheFullError(SpecchatError):
    """The KV pool cannot hold a request even when it runs alone."""
