"""The Open Inference Protocol over gRPC (KServe v2 ``GRPCInferenceService``, the service
Triton serves on 8001) in front of an :class:`~agent.runtime.active_model.ActiveModel`, beside
the HTTP server (``agentctl serve --grpc-port N``).

    ServerLive       live: always true while the server runs
    ServerReady      ready once a version serves
    ModelReady       the model (and version, when given) serves; NOT_FOUND for another model
    ServerMetadata   name, version, extensions
    ModelMetadata    versions, platform, inputs, outputs (as the HTTP metadata)
    ModelInfer       inputs as raw_input_contents (what tritonclient.grpc sends) or typed
                     contents (fp32_contents ...); outputs answered as raw_output_contents

Every request passes the checks the HTTP server makes (:mod:`agent.runtime.oip_request`, one
implementation): finite values in range of the declared datatype, raw lengths equal to shape x
datatype size, the model's input name, datatype and shape, requested outputs the model has.
Status codes: INVALID_ARGUMENT what HTTP answers 400, NOT_FOUND 404, UNAVAILABLE 503 (no
version serves yet), INTERNAL 500 (a non-finite output, a fault), RESOURCE_EXHAUSTED a message
over ``max_message_bytes`` or an RPC past ``max_concurrent_rpcs``; methods of Triton's wider
API (ModelConfig, statistics, shared memory, streaming) are UNIMPLEMENTED.

Bounded (:class:`GrpcLimits`): message size both ways, connections, RPCs accepted at once (one
more is refused at once with RESOURCE_EXHAUSTED: no queue grows without limit) and a fixed pool
of worker threads. A hot swap loses no RPC: each runs on the version it started on
(``ActiveModel.predict_versioned``), and the answer names that version.

Messages come from :mod:`agent.runtime.oip_proto` (a private descriptor pool, so tritonclient
can share the process).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from agent.runtime import oip_proto as pb
from agent.runtime.active_model import ActiveModel
from agent.runtime.oip_request import (
    InferRequest,
    InputTensor,
    ModelSignature,
    RequestedOutput,
    answered,
    bind_inputs,
    check_input_count,
    outputs_wanted,
    validated,
    where_of,
)
from agent.runtime.oip_tensors import (
    DATATYPES,
    ProtocolError,
    datatype_of,
    tensor_from_bytes,
    tensor_from_values,
)
from agent.runtime.serve_metrics import ServeMetrics
from registry.errors import NoActiveModelError

log = logging.getLogger("agent.runtime.oip_grpc")

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 500: grpc.StatusCode.INTERNAL,
          503: grpc.StatusCode.UNAVAILABLE}
_NOT_NUMBERS = {"bool_contents": "booleans are not numbers",
                "bytes_contents": "strings are not numbers"}
"""Why a numeric tensor's values cannot come in these fields (a BOOL tensor's come in the
first: for it, the fields of numbers are simply another datatype's)."""


class GrpcLimits(BaseModel):
    """What one gRPC message and the gRPC server as a whole may take."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_message_bytes: int = Field(default=16 << 20, ge=1024)
    """Largest request message (bytes), refused RESOURCE_EXHAUSTED unread; also the largest
    response."""
    max_concurrent_rpcs: int = Field(default=32, ge=1)
    """RPCs accepted at once, running or waiting for a worker; one more is answered
    RESOURCE_EXHAUSTED at once."""
    workers: int = Field(default=8, ge=1)
    """Threads that run RPCs: a fixed pool."""
    max_connections: int = Field(default=32, ge=1)
    """Client connections open at once (one connection carries many RPCs)."""


def _version() -> str:
    try:
        return importlib.metadata.version("edgetrain")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


def _parameters(params: Any, where: str) -> dict[str, Any]:
    """A protobuf ``map<string, InferParameter>`` as the dict the HTTP path has."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        kind = value.WhichOneof("parameter_choice")
        if kind is None:
            raise ProtocolError(400, f"{where}.parameters.{key}: no value set")
        out[key] = getattr(value, kind)
    return out


def infer_request(request: Any, signature: ModelSignature) -> InferRequest:
    """A ``ModelInferRequest`` checked as the HTTP path checks a body: the model's input and
    the outputs to answer."""
    check_input_count(len(request.inputs), signature)
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(400, f"raw_input_contents holds {len(raw)} entries for "
                            f"{len(request.inputs)} inputs: one per input, in order")
    tensors = []
    for i, p in enumerate(request.inputs):
        t: InputTensor = validated(InputTensor, {
            "name": p.name, "datatype": p.datatype, "shape": list(p.shape),
            "parameters": _parameters(p.parameters, f"inputs[{i}]") or None}, f"inputs[{i}]")
        where, dt = where_of(i, t), DATATYPES[t.datatype]
        given = [f.name for f, _ in p.contents.ListFields()]
        if raw:
            if given:
                raise ProtocolError(400, f"{where}: both raw_input_contents and contents: give "
                                    "one (raw for every input, or contents for every input)")
            tensors.append((t, tensor_from_bytes(raw[i], t.datatype, t.shape, where,
                                                 f"raw_input_contents[{i}]")))
            continue
        if dt.contents is None:
            raise ProtocolError(400, f"{where}: {dt.name} values travel as raw_input_contents "
                                "only (the protocol has no contents field for them)")
        wrong = [f for f in given if f != dt.contents]
        if wrong:
            why = _NOT_NUMBERS.get(wrong[0], "another datatype's field")
            raise ProtocolError(400, f"{where}: contents.{wrong[0]} for {dt.named} tensor "
                                f"({why}): its values go in contents.{dt.contents}")
        values = getattr(p.contents, dt.contents)
        tensors.append((t, tensor_from_values(values, t.datatype, t.shape, where, dt.contents)))
    wanted = [validated(RequestedOutput, {"name": o.name, "parameters":
                                          _parameters(o.parameters, f"outputs[{j}]") or None},
                        f"outputs[{j}]")
              for j, o in enumerate(request.outputs)]
    return InferRequest(bind_inputs(tensors, signature), request.id or None,
                        # raw either way: gRPC answers raw_output_contents, as Triton does
                        outputs_wanted(wanted, signature, default_binary=True),
                        _parameters(request.parameters, "the request"))


class _Service:
    """The six methods, each a plain function of the request; errors become statuses in
    :meth:`handler`."""

    def __init__(self, model: ActiveModel, metrics: ServeMetrics) -> None:
        self.model, self.metrics = model, metrics

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, Callable[[Any], Any]] = {
            "ServerLive": self.server_live, "ServerReady": self.server_ready,
            "ModelReady": self.model_ready, "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata, "ModelInfer": self.model_infer}
        handlers = {}
        for name, fn in methods.items():
            request_cls, response_cls = pb.METHODS[name]
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                self._guarded(fn), request_deserializer=request_cls.FromString,
                response_serializer=response_cls.SerializeToString)
        return grpc.method_handlers_generic_handler(pb.SERVICE, handlers)

    @staticmethod
    def _guarded(fn: Callable[[Any], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return fn(request)
            except ProtocolError as e:
                code, message = _CODES.get(e.status, grpc.StatusCode.INTERNAL), str(e)
            except NoActiveModelError as e:
                code, message = grpc.StatusCode.UNAVAILABLE, str(e)
            except ValueError as e:  # what ActiveModel.predict refuses (shape, dtype)
                code, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
            except Exception as e:  # one bad request never takes the server down
                log.exception("gRPC %s failed", fn.__name__)
                code, message = grpc.StatusCode.INTERNAL, f"internal error: {e}"
            context.abort(code, message)  # raises: the RPC ends with this status

        return call

    def _serving(self, name: str, version: str) -> Any:
        """The engine serving ``name`` (at ``version``, when one is given)."""
        model = self.model
        if name != model.name:
            raise ProtocolError(404, f"unknown model {name!r}: this server serves "
                                f"{model.name!r}")
        engine = model.engine
        if engine is None:
            raise NoActiveModelError(f"no version of {model.name!r} serves yet")
        if version and version != model.version:
            raise ProtocolError(404, f"version {version!r} of {name!r} is not served (serving "
                                f"{model.version!r})")
        return engine

    def server_live(self, request: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    def server_ready(self, request: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.model.version is not None)

    def model_ready(self, request: Any) -> Any:
        try:
            self._serving(request.name, request.version)
        except NoActiveModelError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    def server_metadata(self, request: Any) -> Any:
        return pb.ServerMetadataResponse(name="edgetrain", version=_version(), extensions=[])

    def model_metadata(self, request: Any) -> Any:
        engine = self._serving(request.name, request.version)
        sig = ModelSignature.of(engine)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.model.name, versions=[self.model.version], platform=engine.platform,
            inputs=[tensor(**t.metadata()) for t in sig.inputs],
            outputs=[tensor(**t.metadata()) for t in sig.outputs])

    def model_infer(self, request: Any) -> Any:
        with self.metrics.request(self.model.version) as inference:
            engine = self._serving(request.model_name, request.model_version)
            req = infer_request(request, ModelSignature.of(engine))
            outputs, version = inference.infer(self.model, req.x)
            response = pb.ModelInferResponse(model_name=self.model.name,
                                             model_version=version, id=request.id)
            for wanted, arr in answered(outputs, req.outputs):
                response.outputs.add(name=wanted.name, datatype=datatype_of(arr),
                                     shape=list(arr.shape))
                response.raw_output_contents.append(
                    np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
        return response


class OipGrpcServer:
    """The gRPC service on ``host:port`` (0: a free port, see :attr:`port`); :meth:`start`
    serves from gRPC's threads, :meth:`close` stops."""

    def __init__(self, model: ActiveModel, *, host: str = "127.0.0.1", port: int = 8001,
                 limits: GrpcLimits | None = None, metrics: ServeMetrics | None = None) -> None:
        self.model, self.host = model, host
        self.metrics = metrics or ServeMetrics(model.name)
        """Counted with the HTTP server's when it is theirs (agentctl serve shares one)."""
        self.limits = limits = limits or GrpcLimits()
        self._pool = ThreadPoolExecutor(max_workers=limits.workers,
                                        thread_name_prefix="oip-grpc")
        self._server = grpc.server(
            self._pool, handlers=[_Service(model, self.metrics).handler()],
            maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
            options=[("grpc.max_receive_message_length", limits.max_message_bytes),
                     ("grpc.max_send_message_length", limits.max_message_bytes),
                     ("grpc.max_allowed_incoming_connections", limits.max_connections),
                     # gRPC sets SO_REUSEPORT by default on Linux: a second server would then
                     # bind the same port and take half the requests instead of failing.
                     ("grpc.so_reuseport", 0)])
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._server.add_insecure_port(where)
        except RuntimeError as e:  # gRPC raises where older versions returned 0
            self._pool.shutdown(wait=False)
            raise OSError(f"gRPC cannot listen on {where}: {e}") from None
        if self.port == 0:
            self._pool.shutdown(wait=False)
            raise OSError(f"gRPC cannot listen on {where} (in use?)")

    @property
    def address(self) -> str:
        """``host:port``, as tritonclient.grpc takes it."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> OipGrpcServer:
        self._server.start()
        return self

    def close(self, grace_s: float = 5.0) -> None:
        """Refuse new RPCs, let those running finish for up to ``grace_s``, then stop."""
        self._server.stop(grace_s).wait()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> OipGrpcServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
