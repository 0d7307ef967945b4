"""Listing persisted steps while retention deletes them (`list_persisted`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec.implementations.local as fs_local
import pytest

from unbroken.recovery.persist import apply_retention, list_persisted, step_dir

pytestmark = pytest.mark.unit


def _lay_out(root: Path, steps: list[int]) -> None:
    for step in steps:
        d = Path(step_dir(str(root), step))
        d.mkdir(parents=True)
        (d / "rank-0.ubf").write_bytes(b"x")


def test_a_step_deleted_while_listed_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A clean-clone CI run failed here: the driver's retention removed step 1 between the
    # listing of the root and the listing of step 1's directory.
    _lay_out(tmp_path, [1, 2, 3])
    real_ls = fs_local.LocalFileSystem.ls
    doomed = step_dir(str(tmp_path), 1)

    def ls_after_retention(self: fs_local.LocalFileSystem, path: str, **kw: object) -> object:
        if str(path).rstrip("/") == doomed:
            shutil.rmtree(doomed)  # the other writer's delete lands first
        return real_ls(self, path, **kw)

    monkeypatch.setattr(fs_local.LocalFileSystem, "ls", ls_after_retention)
    assert sorted(list_persisted(str(tmp_path))) == [2, 3]


def test_a_directory_that_is_not_a_step_is_ignored(tmp_path: Path) -> None:
    _lay_out(tmp_path, [4])
    (tmp_path / "step-notes").mkdir()
    (tmp_path / "step-4.tmp").mkdir()
    assert sorted(list_persisted(str(tmp_path))) == [4]


def test_a_step_another_pass_deleted_first_is_not_reported_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lay_out(tmp_path, [1, 2, 3, 4])
    real_rm = fs_local.LocalFileSystem.rm
    raced = step_dir(str(tmp_path), 1)

    def rm_after_other_pass(self: fs_local.LocalFileSystem, path: str, **kw: object) -> None:
        if str(path).rstrip("/") == raced and Path(raced).exists():
            shutil.rmtree(raced)  # the other pass deleted it between our listing and our rm
        real_rm(self, path, **kw)

    monkeypatch.setattr(fs_local.LocalFileSystem, "rm", rm_after_other_pass)
    assert apply_retention(str(tmp_path), [1, 2, 3, 4], keep=2) == [2]
    assert sorted(list_persisted(str(tmp_path))) == [3, 4]
