"""`ConfigError`, which every module of `arl.config` raises: a leaf, importing no other."""


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says what and how."""
