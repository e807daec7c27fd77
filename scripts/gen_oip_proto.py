"""Regenerate ``agent/runtime/oip_proto/descriptor.py`` from ``grpc_predict_v2.proto``.

    python scripts/gen_oip_proto.py            # write it
    python scripts/gen_oip_proto.py --check    # exit 1 when the committed one is stale

The module holds the proto file's serialized ``FileDescriptorProto`` (no source comments),
which ``agent.runtime.oip_proto`` loads into a private descriptor pool. protoc comes from
grpcio-tools (the dev extra); nothing of it is needed at run time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "agent" / "runtime" / "oip_proto"
PROTO = "grpc_predict_v2.proto"
OUT = FOLDER / "descriptor.py"
HEADER = '''"""The serialized descriptor of ``grpc_predict_v2.proto`` (generated: do not edit).

Regenerate with ``python scripts/gen_oip_proto.py`` after changing the proto file.
"""

FILE_DESCRIPTOR = (
'''


def compile_proto() -> descriptor_pb2.FileDescriptorProto:
    """The proto file as protoc reads it."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        rc = protoc.main(["protoc", f"-I{FOLDER}", f"--descriptor_set_out={out}", PROTO])
        if rc != 0:
            raise SystemExit(f"protoc failed on {FOLDER / PROTO} (exit {rc})")
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = fds.file
    return fd


def render(data: bytes) -> str:
    """``data`` as a Python bytes literal, in lines that stay under 100 columns."""
    lines, chunk = [], b""
    for i in range(len(data)):
        piece = data[i:i + 1]
        if len(repr(chunk + piece)) > 90:
            lines.append(f"    {chunk!r}")
            chunk = b""
        chunk += piece
    if chunk:
        lines.append(f"    {chunk!r}")
    return HEADER + "\n".join(lines) + "\n)\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="compare with the committed module instead of writing it")
    args = ap.parse_args(argv)
    fd = compile_proto()
    if args.check:
        namespace: dict[str, object] = {}
        exec(OUT.read_text(), namespace)
        committed = descriptor_pb2.FileDescriptorProto.FromString(
            namespace["FILE_DESCRIPTOR"])  # type: ignore[arg-type]
        if committed != fd:
            print(f"{OUT.relative_to(REPO)} is stale: run python scripts/gen_oip_proto.py",
                  file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(REPO)} matches {PROTO}")
        return 0
    OUT.write_text(render(fd.SerializeToString(deterministic=True)))
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
