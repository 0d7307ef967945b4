"""A storage URL whose fsspec backend is missing names the extra that installs it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from unbroken.common.storage import StorageBackendMissing, url_to_fs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("url", "extra", "module"), [("s3://b/ckpt", "s3", "s3fs"), ("gs://b/ckpt", "gcs", "gcsfs")]
)
def test_a_missing_backend_names_its_extra(url: str, extra: str, module: str) -> None:
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here: the URL opens")
    with pytest.raises(StorageBackendMissing) as info:
        url_to_fs(url)
    assert f"pip install 'unbroken[{extra}]'" in str(info.value) and url in str(info.value)


def test_local_paths_and_file_urls_open(tmp_path: Path) -> None:
    fs, path = url_to_fs(str(tmp_path))
    assert fs.exists(path)
    fs, path = url_to_fs(f"file://{tmp_path}")
    assert fs.isdir(path)
