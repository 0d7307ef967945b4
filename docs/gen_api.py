"""Generate docs/api/proto.md, the reference of every gRPC service and message, from proto/.

`make docs-api` runs this; tests/unit/test_docs_generated.py regenerates the page in memory
and fails when the committed one differs, so the reference never drifts from the .proto
files. The text is the .proto files' own comments: protoc (grpcio-tools) compiles the files
with their source info into a descriptor set, and each service, rpc, message, field and enum
value is listed with the comment written above it (or after it, on its line).
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "docs" / "api" / "proto.md"

# Field numbers of descriptor.proto, for SourceCodeInfo paths.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE, _FILE_SYNTAX = 4, 5, 6, 12
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM = 2, 3, 4
_ENUM_VALUE = 2
_SERVICE_METHOD = 2

_SCALARS = {
    descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE: "double",
    descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT: "float",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT64: "int64",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT64: "uint64",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT32: "int32",
    descriptor_pb2.FieldDescriptorProto.TYPE_FIXED64: "fixed64",
    descriptor_pb2.FieldDescriptorProto.TYPE_FIXED32: "fixed32",
    descriptor_pb2.FieldDescriptorProto.TYPE_BOOL: "bool",
    descriptor_pb2.FieldDescriptorProto.TYPE_STRING: "string",
    descriptor_pb2.FieldDescriptorProto.TYPE_BYTES: "bytes",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT32: "uint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SFIXED32: "sfixed32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SFIXED64: "sfixed64",
    descriptor_pb2.FieldDescriptorProto.TYPE_SINT32: "sint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SINT64: "sint64",
}


def descriptor_set(proto_dir: Path = PROTO) -> descriptor_pb2.FileDescriptorSet:
    """Every .proto of `proto_dir` compiled with its comments (protoc from grpcio-tools).

    Raises:
        RuntimeError: protoc rejected a file (its message is on stderr).
    """
    from grpc_tools import protoc  # dev dependency, imported only here

    names = sorted(p.name for p in proto_dir.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        rc = protoc.main(
            [
                "protoc",
                f"-I{proto_dir}",
                f"--descriptor_set_out={out}",
                "--include_source_info",
                *names,
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto_dir} (exit {rc}); see its message above")
        fds = descriptor_pb2.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
    return fds


def _clean(comment: str) -> str:
    # "// ---- operator API ..." dividers keep their words, not their dashes.
    lines = [re.sub(r"^-{3,}\s*", "", ln.strip()) for ln in comment.strip("\n").split("\n")]
    return " ".join(ln for ln in lines if ln and not set(ln) <= {"-"})


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(full_name: str) -> str:
    return full_name.lower().replace(".", "")


class _Page:
    def __init__(self, fds: descriptor_pb2.FileDescriptorSet) -> None:
        self.fds = fds
        self.known = set()
        for f in fds.file:
            for m in f.message_type:
                self._collect(f.package, m)
            for e in f.enum_type:
                self.known.add(f"{f.package}.{e.name}")
        self.lines: list[str] = []
        self._pkg = ""

    def _collect(self, prefix: str, m: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{m.name}"
        self.known.add(name)
        for n in m.nested_type:
            self._collect(name, n)
        for e in m.enum_type:
            self.known.add(f"{name}.{e.name}")

    def _ref(self, type_name: str) -> str:
        name = type_name.lstrip(".")
        short = name.rsplit(".", 1)[-1]
        if name in self.known:
            return f"[`{short}`](#{_anchor(name)})"
        return f"`{name}`"

    def _type(
        self, fld: descriptor_pb2.FieldDescriptorProto, msg: descriptor_pb2.DescriptorProto
    ) -> str:
        if fld.type in _SCALARS:
            base = f"`{_SCALARS[fld.type]}`"
        else:
            base = self._ref(fld.type_name)
            entry = fld.type_name.rsplit(".", 1)[-1]
            for n in msg.nested_type:
                if n.name == entry and n.options.map_entry:
                    k, v = n.field[0], n.field[1]
                    kt = _SCALARS.get(k.type, k.type_name)
                    vt = f"`{_SCALARS[v.type]}`" if v.type in _SCALARS else self._ref(v.type_name)
                    return f"map<`{kt}`, {vt}>"
        if fld.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
            return f"repeated {base}"
        return base

    def render(self) -> str:
        w = self.lines.append
        w("# gRPC services and messages")
        w("")
        w("Generated from the .proto files under `proto/` by `docs/gen_api.py`")
        w("(`make docs-api`); edit the comments in the .proto files, not this page. The files'")
        w("include root is `proto/`, so any client that loads .proto files takes `proto/` and")
        w("a file name (see [The gRPC API](index.md)).")
        w("")
        for f in sorted(self.fds.file, key=lambda f: f.name):
            self._file(f)
        return "\n".join(self.lines).rstrip("\n") + "\n"

    def _file(self, f: descriptor_pb2.FileDescriptorProto) -> None:
        w = self.lines.append
        comments: dict[tuple[int, ...], str] = {}
        header = ""
        for loc in f.source_code_info.location:
            text = loc.leading_comments or loc.trailing_comments
            if text:
                comments[tuple(loc.path)] = _clean(text)
            if tuple(loc.path) == (_FILE_SYNTAX,) and loc.leading_detached_comments:
                header = "\n".join(
                    ln.strip()
                    for c in loc.leading_detached_comments
                    for ln in c.strip().split("\n")
                )
            if tuple(loc.path) == (_FILE_SYNTAX,) and not header and loc.leading_comments:
                header = "\n".join(ln.strip() for ln in loc.leading_comments.strip().split("\n"))
        self._pkg = f.package
        w(f"## {f.name}")
        w("")
        if f.package:
            w(f"Package `{f.package}`.")
            w("")
        if header:
            w(header)
            w("")
        for si, svc in enumerate(f.service):
            full = f"{f.package}.{svc.name}"
            w(f"### service {svc.name} {{#{_anchor(full)}}}")
            w("")
            if c := comments.get((_FILE_SERVICE, si)):
                w(c)
                w("")
            w("| rpc | request | response | what |")
            w("|---|---|---|---|")
            for mi, m in enumerate(svc.method):
                req = ("stream " if m.client_streaming else "") + self._ref(m.input_type)
                resp = ("stream " if m.server_streaming else "") + self._ref(m.output_type)
                what = _cell(comments.get((_FILE_SERVICE, si, _SERVICE_METHOD, mi), ""))
                w(f"| `{m.name}` | {req} | {resp} | {what} |")
            w("")
        for mi, m in enumerate(f.message_type):
            self._message(f.package, m, (_FILE_MESSAGE, mi), comments)
        for ei, e in enumerate(f.enum_type):
            self._enum(f.package, e, (_FILE_ENUM, ei), comments)

    def _message(
        self,
        prefix: str,
        m: descriptor_pb2.DescriptorProto,
        path: tuple[int, ...],
        comments: dict[tuple[int, ...], str],
    ) -> None:
        if m.options.map_entry:
            return
        w = self.lines.append
        full = f"{prefix}.{m.name}"
        w(f"### {full.removeprefix(self._pkg + '.')} {{#{_anchor(full)}}}")
        w("")
        if c := comments.get(path):
            w(c)
            w("")
        if m.field:
            w("| field | type | # | what |")
            w("|---|---|---|---|")
            for fi, fld in enumerate(m.field):
                what = comments.get((*path, _MSG_FIELD, fi), "")
                if fld.HasField("oneof_index") and not fld.proto3_optional:
                    what = f"(oneof `{m.oneof_decl[fld.oneof_index].name}`) {what}".rstrip()
                w(f"| `{fld.name}` | {self._type(fld, m)} | {fld.number} | {_cell(what)} |")
            w("")
        for ni, n in enumerate(m.nested_type):
            self._message(full, n, (*path, _MSG_NESTED, ni), comments)
        for ei, e in enumerate(m.enum_type):
            self._enum(full, e, (*path, _MSG_ENUM, ei), comments)

    def _enum(
        self,
        prefix: str,
        e: descriptor_pb2.EnumDescriptorProto,
        path: tuple[int, ...],
        comments: dict[tuple[int, ...], str],
    ) -> None:
        w = self.lines.append
        full = f"{prefix}.{e.name}"
        w(f"### enum {full.removeprefix(self._pkg + '.')} {{#{_anchor(full)}}}")
        w("")
        if c := comments.get(path):
            w(c)
            w("")
        w("| value | # | what |")
        w("|---|---|---|")
        for vi, v in enumerate(e.value):
            what = _cell(comments.get((*path, _ENUM_VALUE, vi), ""))
            w(f"| `{v.name}` | {v.number} | {what} |")
        w("")


def render(proto_dir: Path = PROTO) -> str:
    """The page's Markdown for the .proto files of `proto_dir`."""
    return _Page(descriptor_set(proto_dir)).render()


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
    import genpage

    return genpage.main(__doc__, OUT, ROOT, render, "docs-api", argv)


if __name__ == "__main__":
    sys.exit(main())
