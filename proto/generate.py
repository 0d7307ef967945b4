"""Generate the protobuf/gRPC stubs for every .proto in this folder.

`make proto` runs this. The stubs are committed; `--check` regenerates into a temporary
folder and fails when the committed ones differ (tests/unit/test_proto_fresh.py).

Two views of one set of files:
- For any other client (grpcurl, Node's proto-loader, protoc for another language) the
  include root is this folder: `-I proto driver.proto`, and the sources import each other
  by bare name (`import "events.proto";`). tests/unit/test_proto_load.py loads them so.
- For our Python stubs they are compiled as if they lived at unbroken/proto/ (a copy, with
  each import of a sibling rewritten to `unbroken/proto/<name>`), so generated imports read
  `from unbroken.proto import x_pb2`, work from the installed namespace, and the files
  register in protobuf's global pool as `unbroken/proto/x.proto`, never as a bare
  `events.proto` that another library's file of that name would collide with.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
PACKAGE_DIR = "unbroken/proto"
IMPORT = re.compile(r'^(\s*import\s+(?:public\s+|weak\s+)?")([^"/]+\.proto)(";)', re.MULTILINE)


def namespaced(text: str, siblings: set[str]) -> str:
    """The .proto source with each import of a sibling file moved under `PACKAGE_DIR`.

    Raises:
        ValueError: a bare import names no file of this folder.
    """

    def sub(m: re.Match[str]) -> str:
        if m.group(2) not in siblings:
            raise ValueError(f"import {m.group(2)!r} names no .proto file of proto/")
        return f"{m.group(1)}{PACKAGE_DIR}/{m.group(2)}{m.group(3)}"

    return IMPORT.sub(sub, text)


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto in this folder into `out_dir`; return the files written."""
    from grpc_tools import protoc  # dev dependency, imported only here

    with tempfile.TemporaryDirectory() as tmp:
        src_root = Path(tmp) / "src"
        pkg = src_root / PACKAGE_DIR
        pkg.mkdir(parents=True)
        protos = sorted(HERE.glob("*.proto"))
        names = {p.name for p in protos}
        for p in protos:
            (pkg / p.name).write_text(namespaced(p.read_text(), names))
        gen_root = Path(tmp) / "gen"
        gen_root.mkdir()
        proto_include = Path(protoc.__file__).parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{src_root}",
            f"-I{proto_include}",
            f"--python_out={gen_root}",
            f"--pyi_out={gen_root}",
            f"--grpc_python_out={gen_root}",
            *[f"{PACKAGE_DIR}/{p.name}" for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed; see the message above")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted((gen_root / PACKAGE_DIR).iterdir()):
            if f.name.endswith(SUFFIXES):
                shutil.copy(f, out_dir / f.name)
                written.append(out_dir / f.name)
        return written


def stale() -> list[str]:
    """Names of committed stubs that differ from freshly generated ones (or are missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        names = {f.name for f in fresh}
        bad = [
            f.name
            for f in fresh
            if not (HERE / f.name).exists() or not filecmp.cmp(f, HERE / f.name, shallow=False)
        ]
        bad += [p.name for p in HERE.iterdir() if p.name.endswith(SUFFIXES) and p.name not in names]
        return sorted(bad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    ns = ap.parse_args()
    if ns.check:
        bad = stale()
        if bad:
            sys.exit(f"stale generated stubs: {', '.join(bad)}; run `make proto` and commit")
        print("proto stubs are fresh")
        return
    for f in generate(HERE):
        print(f"wrote {f.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
