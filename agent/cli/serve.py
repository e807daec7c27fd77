"""``agentctl serve``: the committed model over the Open Inference Protocol (KServe v2 /
Triton HTTP, and gRPC when asked), following commits without a restart (``agent.runtime``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from agent.cli.common import add_state_args, fail, guarded, state_dir_of
from registry.credentials import is_loopback
from registry.lifetime import wait_for_stop

log = logging.getLogger("agent.cli.serve")

SERVE_EPILOG = """\
Serves MODEL's active slot (STATE_DIR/models/MODEL/current) with its TensorRT engine where one
was built for this host, else its ONNX file in ONNX Runtime (the best provider it has). A
version committed later (agentctl deploy, a fine-tune job, agentctl pull) is loaded and
warmed beside the old one, then takes over between two requests: none fails or waits on the
swap. No daemon is needed. With no committed model yet it starts anyway, answers ready 400,
and serves the first version committed.

endpoints (Open Inference Protocol v2): GET /v2/health/live, /v2/health/ready,
/v2/models/MODEL, /v2/models/MODEL/ready; POST /v2/models/MODEL/infer (JSON, or the binary
tensor data extension tritonclient uses). Every connection, request and body is bounded:
--max-body-mb, --max-connections (503 beyond, at accept), --request-timeout-s (a whole body;
and a whole request head, from accept, unless --header-timeout-s), --infer-threads. Waiting
connections are coroutines (uvicorn), not threads: a client dripping its headers is cut at
the deadline and holds nothing but its socket until then.

gRPC (the protocol's GRPCInferenceService, as Triton serves it on 8001; tritonclient.grpc
works unchanged): off unless --grpc-port is given, on --host like HTTP. Bounded too: a
message is at most --max-body-mb, --max-connections connections, --grpc-max-rpcs RPCs at
once (one more is refused RESOURCE_EXHAUSTED, not queued), run by --grpc-workers threads.

Requests are checked strictly, the same way on both: finite numbers within the declared
datatype's range (no NaN/Inf, no 1e39 for FP32, in JSON and in raw bytes), no strings or
booleans for numbers, raw byte counts equal to shape x datatype size, the datatype the
model's metadata declares (FP32), requested outputs the model has. A refusal is a 400 /
INVALID_ARGUMENT naming the input and the fix; a NaN or Inf output is a 500 / INTERNAL,
never a NaN in JSON.

Every output of the model is served in the datatype it declares: a classifier's FP32 logits;
an exported detector's num_detections [N,1] INT32, boxes [N,K,4] FP32, scores [N,K] FP32 and
classes [N,K] INT32 (EfficientNMS_TRT's layout), INT32 as JSON integers or raw int32. The
metadata lists them all; a request may name the ones it wants in "outputs".

GET /metrics: Prometheus' text format, on the same port: Triton's inference counters under
Triton's names and labels (nv_inference_request_success, nv_inference_request_failure with
its reason, nv_inference_count, nv_inference_exec_count, nv_inference_request_duration_us,
nv_inference_compute_infer_duration_us; HTTP and gRPC requests together), so a Triton
dashboard reads this server, and a histogram of the request time
(edgetrain_inference_request_duration_seconds). Loopback-only unless --allow-remote.

examples:
  agentctl serve --state-dir /var/lib/edge-agent --model digits --unix-socket /run/app/oip.sock
  curl --unix-socket /run/app/oip.sock http://localhost/v2/models/digits
  curl --unix-socket /run/app/oip.sock http://localhost/v2/models/digits/infer \\
      -H 'Content-Type: application/json' -d '{"inputs": [{"name": "input", "datatype": "FP32",
      "shape": [1, 1, 8, 8], "data": [0, 0, ...64 values...]}]}'

  agentctl serve --model digits --port 8000 --slo-ms 20
  python - <<'EOF'
  import numpy as np, tritonclient.http as http
  c = http.InferenceServerClient("127.0.0.1:8000")
  x = http.InferInput("input", [4, 1, 8, 8], "FP32")
  x.set_data_from_numpy(np.zeros((4, 1, 8, 8), np.float32))   # sent as binary data
  print(c.infer("digits", [x]).as_numpy("logits").argmax(1))
  EOF

  agentctl serve --model digits --port 8000 --grpc-port 8001
  python - <<'EOF'
  import numpy as np, tritonclient.grpc as grpcclient
  c = grpcclient.InferenceServerClient("127.0.0.1:8001")
  x = grpcclient.InferInput("input", [4, 1, 8, 8], "FP32")
  x.set_data_from_numpy(np.zeros((4, 1, 8, 8), np.float32))
  print(c.infer("digits", [x]).as_numpy("logits").argmax(1))
  EOF

The endpoints have no authentication and no TLS: they listen on loopback (or a Unix socket,
whose file mode 0660 is the access control) unless --allow-remote.
Stop it with SIGTERM or Ctrl-C. Exit codes: 0 stopped, 2 bad arguments.
"""


def run_serve(args: argparse.Namespace) -> int:
    from agent.runtime.active_model import ActiveModel
    from agent.runtime.oip import OipLimits, OipServer
    from hpc_core.logs import setup_logging

    setup_logging(args.log_format)
    on_tcp = args.unix_socket is None or args.grpc_port is not None
    if on_tcp and not is_loopback(args.host) and not args.allow_remote:
        return fail(2, f"serve: --host {args.host} is not a loopback address: the endpoint has "
                    "no authentication or TLS, so anyone who reaches the port can run the model "
                    "(and load the device); put a proxy with TLS in front, or pass "
                    "--allow-remote to accept that")
    for flag in ("grpc_max_rpcs", "grpc_workers"):
        if getattr(args, flag) < 1:
            return fail(2, f"serve: --{flag.replace('_', '-')} {getattr(args, flag)}: give at "
                        "least 1")
    if args.slo_ms is not None and args.slo_ms <= 0:
        return fail(2, f"serve: --slo-ms {args.slo_ms}: give a positive number of ms")
    try:
        limits = OipLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)),
                           max_connections=args.max_connections,
                           request_timeout_s=args.request_timeout_s,
                           header_timeout_s=args.header_timeout_s,
                           infer_threads=args.infer_threads)
    except ValueError as e:
        return fail(2, f"serve: {' '.join(str(e).split())[:300]}")
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    providers = args.providers.split(",") if args.providers else None
    spool = None
    if args.spool_data_root is not None:
        from agent.spool.config import SpoolConfig, spool_dir
        from agent.spool.store import Spool

        try:
            cfg = SpoolConfig(quota_mb=args.spool_quota_mb,
                              pseudo_label_threshold=args.pseudo_label_threshold)
        except ValueError as e:
            return fail(2, f"serve: spool: {' '.join(str(e).split())[:300]}")
        spool = Spool(spool_dir(args.spool_data_root, args.model), cfg)
    with ActiveModel(state_dir_of(args), args.model, providers=providers,
                     threads=args.threads, spin=args.spin, slo_ms=args.slo_ms,
                     spool=spool) as model:
        if model.version is None:
            log.info("no committed version of %s yet: serving it once one is committed%s",
                     args.model, f" ({model.last_error})" if model.last_error else "",
                     extra={"fields": {"event": "waiting", "model": args.model}})
        with contextlib.ExitStack() as servers:
            server = servers.enter_context(
                OipServer(model, host=args.host, port=args.port, unix_socket=args.unix_socket,
                          limits=limits).start())
            grpc_address = None
            if args.grpc_port is not None:
                from agent.runtime.oip_grpc import GrpcLimits, OipGrpcServer

                grpc_limits = GrpcLimits(max_message_bytes=limits.max_body_bytes,
                                         max_concurrent_rpcs=args.grpc_max_rpcs,
                                         workers=args.grpc_workers,
                                         max_connections=args.max_connections)
                grpc_address = servers.enter_context(OipGrpcServer(
                    model, host=args.host, port=args.grpc_port, limits=grpc_limits,
                    metrics=server.metrics).start()
                ).address
            engine = model.engine
            log.info("serving %s@%s on %s%s (%s)", args.model, model.version, server.address,
                     f" and grpc {grpc_address}" if grpc_address else "",
                     f"{engine.name} on {', '.join(engine.providers)}" if engine else "-",
                     extra={"fields": {"event": "serving", "model": args.model,
                                       "version": model.version, "address": server.address,
                                       "grpc_address": grpc_address}})
            wait_for_stop(stop)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the committed model over HTTP and gRPC (Open Inference Protocol v2)",
        description="Serve a model's committed version to applications (KServe v2 / Triton "
        "HTTP, and gRPC with --grpc-port), following commits with zero failed requests.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="NAME", help="installed model name")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    where.add_argument("--unix-socket", type=Path, metavar="PATH",
                       help="listen on this Unix socket (mode 0660) instead of TCP")
    p.add_argument("--host", default="127.0.0.1",
                   help="TCP address of --port and --grpc-port (default 127.0.0.1)")
    p.add_argument("--allow-remote", action="store_true",
                   help="accept a non-loopback --host (the endpoint has no auth or TLS)")
    p.add_argument("--slo-ms", type=float, metavar="N",
                   help="the application's p99 latency objective, reported to the governor")
    p.add_argument("--threads", type=int, default=0,
                   help="ONNX Runtime intra-op threads (default 0: all cores)")
    p.add_argument("--spin", action="store_true",
                   help="let ONNX Runtime's threads spin between requests: a little lower "
                   "latency with more than one thread, for a core kept busy while idle (by "
                   "default they sleep: on a device that core is the fine-tune's)")
    p.add_argument("--providers", metavar="LIST",
                   help="ONNX Runtime providers, comma-separated (default: the best available, "
                   "TensorRT > CUDA > CPU)")
    p.add_argument("--max-body-mb", type=float, default=16.0,
                   help="largest request body (and gRPC message) in MiB (default 16)")
    p.add_argument("--max-connections", type=int, default=512,
                   help="connections held at once, per protocol; one more is answered 503 "
                   "(gRPC: refused) (default 512)")
    p.add_argument("--request-timeout-s", type=float, default=10.0,
                   help="a whole request body must arrive within this many seconds; also the "
                   "header deadline and the idle keep-alive unless given (default 10)")
    p.add_argument("--header-timeout-s", type=float, metavar="S",
                   help="a request's whole line and headers must arrive within this many "
                   "seconds from accept, or from the previous response (default: "
                   "--request-timeout-s)")
    p.add_argument("--infer-threads", type=int, default=4,
                   help="requests run through the model at once, each on a thread (default 4)")
    # Off unless asked: a second unauthenticated listener is the operator's choice, and its
    # port (Triton's 8001 by convention) the operator's too.
    p.add_argument("--grpc-port", type=int, metavar="N",
                   help="also serve the protocol's gRPC service on --host:N (0: a free port, "
                   "logged); default: no gRPC")
    p.add_argument("--grpc-max-rpcs", type=int, default=32, metavar="N",
                   help="gRPC calls accepted at once (default 32); one more is refused "
                   "RESOURCE_EXHAUSTED")
    p.add_argument("--grpc-workers", type=int, default=8, metavar="N",
                   help="threads that run gRPC calls (default 8)")
    p.add_argument("--spool-data-root", type=Path, metavar="DIR",
                   help="keep the samples POSTed to /v2/models/MODEL/record in DIR/spool/MODEL "
                   "(give the daemon's data_root: a finetune with data: spool trains on them)")
    p.add_argument("--spool-quota-mb", type=float, default=256.0,
                   help="the spool's disk quota in MiB (default 256); hard examples stay")
    p.add_argument("--pseudo-label-threshold", type=float, metavar="P",
                   help="keep an unlabelled sample whose top probability reaches P, "
                   "pseudo-labelled (default: unlabelled samples are not kept)")
    p.add_argument("--log-format", choices=("auto", "text", "json"), default="auto")
    add_state_args(p, trusted=False)
    p.set_defaults(func=guarded(run_serve))
