"""The one small exception hierarchy of the store.

A miss is a value (``None`` or ``False``), never an exception.  Code that
raises one of these has already rolled back whatever it took.
"""


class FlatCakeError(Exception):
    """Base of every error the store raises on purpose."""


class ConfigError(FlatCakeError, ValueError):
    """A setting has a value that is not allowed; the message names it."""


class LayoutMismatchError(FlatCakeError):
    """The store on disk was written with another layout or format version."""


class StoreCorruptError(FlatCakeError):
    """Metadata on disk cannot be parsed (not raised for torn segments: they are dropped)."""


class NotStoredError(FlatCakeError):
    """A write could not be stored (full disk, capacity, I/O error); nothing was kept."""


class IOEngineError(FlatCakeError, OSError):
    """An I/O command failed; the operation it belonged to failed with it."""


class UnsafeMediumError(FlatCakeError):
    """The SSD region medium (``ssd_path``) is refused: mounted, in use, holds data that is
    not flatcake's, or too small.  The message says which; nothing was written to it."""


class UnsafeStoreError(FlatCakeError):
    """A store directory other local users could reach (not the user's own, writable by
    others, or a link someone else planted); the message names it.  Nothing was written."""


class StoreClosedError(FlatCakeError):
    """A call on a store after ``close()``."""
