"""The .proto files load as a foreign client loads them: one include root, `proto/`.

grpcurl, Node's proto-loader or protoc for another language take the repository's proto/
folder as the include root and a file name in it. The grpcurl recipe of docs/api/index.md is
read from that page and run with grpc_tools' protoc (in process), so the recipe stays true;
what it loads must be what our generated stubs were built from.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="needs grpcio-tools"),
]

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"


def load(include_root: Path, proto: str, out: Path) -> descriptor_pb2.FileDescriptorSet:
    """protoc's descriptor set of `proto` (with its imports), from `include_root` only."""
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{include_root}",
        # protoc's own well-known types, as grpcurl and proto-loader bundle them
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        "--include_imports",
        f"--descriptor_set_out={out}",
        str(include_root / proto),
    ]
    assert protoc.main(args) == 0, f"protoc could not load {proto} from {include_root}"
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def without_json_names(m: descriptor_pb2.DescriptorProto) -> descriptor_pb2.DescriptorProto:
    """`m` without the json_name protoc fills in (a stub's descriptor leaves it out)."""
    out = descriptor_pb2.DescriptorProto()
    out.CopyFrom(m)
    for f in out.field:
        f.ClearField("json_name")
    nested = [without_json_names(n) for n in out.nested_type]
    del out.nested_type[:]
    out.nested_type.extend(nested)
    return out


API_PAGE = ROOT / "docs" / "api" / "index.md"


def readme_recipe() -> tuple[str, str]:
    """The `-import-path DIR -proto FILE` of the API page's grpcurl recipe."""
    text = API_PAGE.read_text()
    m = re.search(r"grpcurl [^`\n]*-import-path (\S+) -proto (\S+)", text)
    assert m, "docs/api/index.md lost its grpcurl recipe (-import-path DIR -proto FILE)"
    return m.group(1), m.group(2)


def test_the_readme_recipe_loads_the_driver_api(tmp_path: Path) -> None:
    import_path, proto = readme_recipe()
    fds = load(ROOT / import_path, proto, tmp_path / "set.pb")
    files = {f.name: f for f in fds.file}
    assert proto in files
    services = [f"{f.package}.{s.name}" for f in fds.file for s in f.service]
    assert "unbroken.driver.v1.Driver" in services
    # the recipe's example calls name methods the loaded service has
    readme = API_PAGE.read_text()
    methods = {m.name for f in fds.file for s in f.service for m in s.method}
    for called in re.findall(r"unbroken\.driver\.v1\.Driver/(\w+)", readme):
        assert called in methods, (
            f"docs/api/index.md calls Driver/{called}, which driver.proto lacks"
        )


@pytest.mark.parametrize("proto", sorted(p.name for p in PROTO.glob("*.proto")))
def test_every_proto_loads_from_one_include_root_as_the_stubs_were_built(
    proto: str, tmp_path: Path
) -> None:
    fds = load(PROTO, proto, tmp_path / "set.pb")
    stub = importlib.import_module(f"unbroken.proto.{proto.removesuffix('.proto')}_pb2")
    built = descriptor_pb2.FileDescriptorProto()
    stub.DESCRIPTOR.CopyToProto(built)
    (loaded,) = [f for f in fds.file if f.name == proto]
    # the same messages, enums and services, field for field; only the file names differ
    # (the stubs are registered as unbroken/proto/<name>, see proto/generate.py)
    assert loaded.package == built.package
    assert [without_json_names(m) for m in loaded.message_type] == list(built.message_type)
    assert list(loaded.enum_type) == list(built.enum_type)
    assert list(loaded.service) == list(built.service)
    assert [d.rpartition("/")[2] for d in built.dependency] == list(loaded.dependency)
