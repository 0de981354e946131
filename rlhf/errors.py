"""The error every config check raises (rlhf.config re-exports it), in a module of its own so that the modules
rlhf.config's checks call (the rewards) can raise it without importing rlhf.config back."""


class ConfigError(ValueError):
    """A bad config: the message names the key, the bad value and what would be valid."""
