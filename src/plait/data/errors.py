"""``DataError``, in a module without torch: the processes that tokenise into the token cache import it."""

from __future__ import annotations

from plait.config import ConfigError


class DataError(ConfigError):
    """The data named by the config cannot be used; the message says what to do."""
