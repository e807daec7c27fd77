"""The Open Inference Protocol's gRPC messages (``grpc_predict_v2.proto``, package
``inference``), as protobuf message classes of a private descriptor pool.

Why not protoc's ``_pb2.py`` modules: those register their messages in protobuf's one
process-wide default pool, and so do tritonclient's and KServe's (the same package and message
names); two of them in one process fail at import with "duplicate symbol
'inference.ServerLiveRequest'". An application that serves with ``agentctl serve``'s server
in-process and talks to Triton with tritonclient, or a test that drives this server with
tritonclient, would crash. A private pool holds the same descriptor (the wire is identical)
without the clash, and needs no generated code that pins a protobuf version: any protobuf
with ``message_factory.GetMessageClass`` reads it.

``descriptor.py`` is generated from the proto file (``python scripts/gen_oip_proto.py``).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pool, message_factory

from agent.runtime.oip_proto.descriptor import FILE_DESCRIPTOR

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"
"""The service's full name: the first part of every method's path on the wire."""

_pool = descriptor_pool.DescriptorPool()
_pool.AddSerializedFile(FILE_DESCRIPTOR)


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ServerLiveRequest = _message("ServerLiveRequest")
ServerLiveResponse = _message("ServerLiveResponse")
ServerReadyRequest = _message("ServerReadyRequest")
ServerReadyResponse = _message("ServerReadyResponse")
ModelReadyRequest = _message("ModelReadyRequest")
ModelReadyResponse = _message("ModelReadyResponse")
ServerMetadataRequest = _message("ServerMetadataRequest")
ServerMetadataResponse = _message("ServerMetadataResponse")
ModelMetadataRequest = _message("ModelMetadataRequest")
ModelMetadataResponse = _message("ModelMetadataResponse")
InferParameter = _message("InferParameter")
InferTensorContents = _message("InferTensorContents")
ModelInferRequest = _message("ModelInferRequest")
ModelInferResponse = _message("ModelInferResponse")

METHODS: dict[str, tuple[Any, Any]] = {
    m.name: (_message(m.input_type.name), _message(m.output_type.name))
    for m in _pool.FindServiceByName(SERVICE).methods
}
"""Method name -> (request class, response class), as the proto file declares them."""
