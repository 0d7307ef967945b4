"""Storage URLs (checkpoints, the event log's archive) through fsspec, with the missing
backend named as the extra that installs it.

fsspec knows s3:// and gs:// but their implementations (s3fs, gcsfs) are separate packages;
unbroken ships them as the extras `[s3]` and `[gcs]`, so a URL whose backend is missing
fails with the command that fixes it instead of fsspec's bare ImportError.
"""

from __future__ import annotations

from typing import Any

import fsspec
import fsspec.core

#: URL scheme -> the extra of unbroken that installs its fsspec backend.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class StorageBackendMissing(ImportError):
    """The fsspec backend of a storage URL is not installed; the message says how to get it."""


def url_to_fs(url: str, **kwargs: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """`fsspec.core.url_to_fs`, naming the extra to install when the backend is missing.

    Raises:
        StorageBackendMissing: the URL's scheme needs a package that is not installed.
    """
    try:
        fs, path = fsspec.core.url_to_fs(url, **kwargs)
    except ImportError as e:
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        extra = EXTRAS.get(scheme)
        hint = (
            f"pip install 'unbroken[{extra}]'"
            if extra
            else f"install the fsspec backend of {scheme}://"
        )
        raise StorageBackendMissing(f"storage URL {url!r} needs a package: {e}; {hint}") from e
    return fs, path
