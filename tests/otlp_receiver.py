"""A real OTLP/HTTP trace receiver on loopback for the tests: what an OpenTelemetry
collector's ``otlphttp`` receiver does with ``POST /v1/traces``, decoding each body as the
protobuf ``ExportTraceServiceRequest`` (the ``opentelemetry-proto`` package the OTLP
exporter depends on) into plain span records."""

from __future__ import annotations

import gzip
import http.server
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReceivedSpan:
    """One span as it arrived: ids in lower-case hex (``parent_span_id`` "" for a root),
    times in Unix nanoseconds, attributes decoded to Python values, and the service name
    of its resource."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    service: str


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for sp in ss.spans:
                out.append(
                    ReceivedSpan(
                        name=sp.name,
                        trace_id=sp.trace_id.hex(),
                        span_id=sp.span_id.hex(),
                        parent_span_id=sp.parent_span_id.hex(),
                        start_ns=sp.start_time_unix_nano,
                        end_ns=sp.end_time_unix_nano,
                        attributes={kv.key: _value(kv.value) for kv in sp.attributes},
                        service=str(res.get("service.name", "")),
                    )
                )
    return out


@dataclass
class OtlpReceiver:
    """``with OtlpReceiver() as r:`` serves ``r.url`` (``http://127.0.0.1:PORT/v1/traces``)
    until the block ends; ``r.spans`` holds every span received, ``r.errors`` what could
    not be decoded (path, content type, problem)."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    requests: int = 0
    _server: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}/v1/traces"

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def __enter__(self) -> OtlpReceiver:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the handler's protocol)
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceResponse,
                )

                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                enc = (self.headers.get("Content-Encoding") or "").lower()
                try:
                    if self.path != "/v1/traces":
                        raise ValueError(f"path {self.path}")
                    if self.headers.get("Content-Type") != "application/x-protobuf":
                        raise ValueError(f"content type {self.headers.get('Content-Type')}")
                    if enc == "gzip":
                        body = gzip.decompress(body)
                    elif enc == "deflate":
                        body = zlib.decompress(body)
                    spans = decode(body)
                except Exception as e:  # said in `errors`, answered 400 like a collector
                    with receiver._lock:
                        receiver.errors.append(f"{type(e).__name__}: {e}")
                    self.send_response(400)
                    self.end_headers()
                    return
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.requests += 1
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
