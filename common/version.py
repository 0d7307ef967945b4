"""The package's version, from one source: `version` in pyproject.toml.

The installed distribution's metadata carries it (`importlib.metadata`), for a wheel and an
editable install alike, so nothing here repeats the number. A checkout imported without
being installed has no metadata and reports `0+unknown`.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "unbroken"

try:
    __version__ = metadata.version(DISTRIBUTION)
except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"
