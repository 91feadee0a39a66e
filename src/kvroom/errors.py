"""Exception types. User mistakes raise a ``KvroomError``; the CLI maps it to exit code 2."""

from __future__ import annotations


class KvroomError(Exception):
    """Base of every error caused by user input or the environment, never by a kvroom bug."""


class ConfigError(KvroomError, ValueError):
    """A configuration field holds a bad value; the message names the field and the value."""


class MemoryNotEnoughError(ConfigError):
    """The KV pool cannot hold one full-length sequence. Message starts ``Memory is not enough``."""


class ArtifactError(KvroomError, ValueError):
    """A folder is not a readable kvroom artifact (missing, corrupted, or from the future)."""


class ModelSourceError(KvroomError, ValueError):
    """A model path cannot be read, or holds an architecture kvroom does not support."""


class AdmissionError(KvroomError, ValueError):
    """A request can never be served by this engine (too long, or larger than the whole pool)."""
