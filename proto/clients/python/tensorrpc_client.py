#!/usr/bin/env python3
"""A third-party tensorrpc client built from proto/tensorrpc.proto alone.

It proves that the .proto is the whole contract of the plain-gRPC fallback:
it opens a Session offering no data plane, fetches, sends and calls over
the unary methods (small tensors, inline) and the streaming methods (large
tensors, in Chunks), and checks every byte and every status code it was
promised. It runs against the server of rpc/thirdparty_test.go, which
publishes the tensors below, registers the method "thirdparty.scale" and
checks what this client sent.

    python3 proto/clients/python/tensorrpc_client.py [--pb-dir DIR] HOST:PORT

Needs Debian's python3-grpcio and python3-protobuf. The Python code for the
messages is generated at run time with protoc (Debian's protobuf-compiler)
into a temporary directory, or taken from --pb-dir; the service stub is
built from the descriptor in that code with grpc's generic API, so nothing
but tensorrpc.proto is used. (Debian bookworm's python3-grpc-tools bundles
a protoc too old for proto3 `optional`, so it cannot compile the .proto.)

Exit status 0 when every check passed; otherwise the failed check is
printed to stderr.
"""

import argparse
import array
import atexit
import os
import queue
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import types

try:
    import grpc
except ImportError:
    sys.exit("tensorrpc_client.py: cannot import grpc: install Debian's python3-grpcio")
try:
    import google.protobuf  # noqa: F401
except ImportError:
    sys.exit("tensorrpc_client.py: cannot import google.protobuf: install Debian's python3-protobuf")

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.normpath(os.path.join(HERE, "..", ".."))

MiB = 1 << 20
TIMEOUT = 60  # seconds, for every call

# Tensor bytes are little-endian; this client builds them with array and
# struct, which use the host's order.
if sys.byteorder != "little":
    sys.exit("tensorrpc_client.py: tensor bytes are little-endian; this client assumes a little-endian host")


def load_pb2(pb_dir):
    """Imports tensorrpc_pb2, generating it from the .proto when needed."""
    if pb_dir is None:
        pb_dir = tempfile.mkdtemp(prefix="tensorrpc-pb-")
        atexit.register(shutil.rmtree, pb_dir, True)
        protoc = os.environ.get("PROTOC", "protoc")
        if shutil.which(protoc) is None:
            sys.exit("tensorrpc_client.py: protoc not found: install Debian's protobuf-compiler")
        subprocess.run([protoc, "-I", PROTO_DIR, "--python_out=" + pb_dir,
                        os.path.join(PROTO_DIR, "tensorrpc.proto")], check=True)
    sys.path.insert(0, pb_dir)
    import tensorrpc_pb2  # noqa: E402
    return tensorrpc_pb2


def make_stub(pb, channel):
    """A stub with one callable per method of service TensorRPC, made from
    the descriptor: the method paths, message types and streaming kinds all
    come from the .proto."""
    svc = pb.DESCRIPTOR.services_by_name["TensorRPC"]
    kinds = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    stub = types.SimpleNamespace()
    for m in svc.methods:
        req, resp = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        make = kinds[(m.client_streaming, m.server_streaming)]
        setattr(stub, m.name, make("/%s/%s" % (svc.full_name, m.name),
                                   request_serializer=req.SerializeToString,
                                   response_deserializer=resp.FromString))
    return stub


class CheckFailed(Exception):
    pass


def check(cond, what):
    if not cond:
        raise CheckFailed(what)


def expect_code(code, fn, what):
    """Runs fn and checks that it fails with the gRPC status code."""
    try:
        fn()
    except grpc.RpcError as e:
        check(e.code() == code, "%s: got %s (%s), want %s" % (what, e.code(), e.details(), code))
        print("ok   %s: %s" % (what, code.name))
        return
    raise CheckFailed("%s: succeeded, want %s" % (what, code))


# The tensors, as rpc/thirdparty_test.go makes and checks them.

def f32(values):
    return array.array("f", values).tobytes()


def big_bytes():
    """"big": float32[1536, 1024], element i = (i % 1024) * 0.25 - 100."""
    period = f32([(i % 1024) * 0.25 - 100 for i in range(1024)])
    return period * 1536


def py_big_bytes():
    """"py.big": float32[3, 1048576], element i = i % 4096 - 2048."""
    period = f32([float(i % 4096 - 2048) for i in range(4096)])
    return period * (3 * MiB // 4096)


def f16_bits(x):
    """IEEE 754 binary16, little-endian (struct's 'e' format)."""
    return struct.pack("<e", x)


def bf16_bits(x):
    """bfloat16: the upper 16 bits of the float32 (exact for these values),
    little-endian."""
    return struct.pack("<f", x)[2:4]


class Client:
    def __init__(self, pb, addr):
        self.pb = pb
        # Our chunks are up to 8 MiB (the server accepts 16 MiB, see Chunk in
        # the .proto); replies stay within gRPC's default 4 MiB, but a server
        # with a large eager threshold may send larger inline replies.
        self.channel = grpc.insecure_channel(addr, options=[
            ("grpc.max_send_message_length", 64 * MiB),
            ("grpc.max_receive_message_length", 64 * MiB),
        ])
        self.api = make_stub(pb, self.channel)
        self.session_id = ""
        self.eager = 0

    # Session: a handshake offering only TRANSPORT_GRPC (which needs no
    # offer; the server ignores it), answered by the server's handshake and
    # its choice of TRANSPORT_GRPC. The stream stays open for the session's
    # life: the request iterator blocks until close_session.
    def open_session(self):
        pb = self.pb
        self.requests = queue.Queue()

        def requests():
            while True:
                m = self.requests.get()
                if m is None:
                    return  # half-close: ends the session
                yield m

        self.session = self.api.Session(requests())
        self.requests.put(pb.SessionRequest(handshake=pb.HandshakeRequest(
            protocol_version=2, client_name="python-thirdparty",
            offers=[pb.TransportOffer(transport=pb.TRANSPORT_GRPC, description="python grpcio")])))
        r = next(self.session)
        check(r.WhichOneof("msg") == "handshake", "first session message is %s, want handshake" % r.WhichOneof("msg"))
        check(r.handshake.protocol_version == 2, "protocol_version %d" % r.handshake.protocol_version)
        check(r.handshake.session_id != "", "empty session id")
        self.session_id, self.eager = r.handshake.session_id, r.handshake.eager_threshold
        r = next(self.session)
        check(r.WhichOneof("msg") == "choice" and r.choice.transport == pb.TRANSPORT_GRPC,
              "second session message %s, want choice TRANSPORT_GRPC" % r)
        print("ok   session %s on TRANSPORT_GRPC, eager threshold %d" % (self.session_id, self.eager))

    def close_session(self):
        self.requests.put(None)
        try:
            for r in self.session:
                raise CheckFailed("session message after the choice: %s" % r)
        except grpc.RpcError:
            pass  # the server ends the stream once the client half-closed

    # Fetch (inline) and FetchStream.
    def fetch(self, key, **kw):
        r = self.api.Fetch(self.pb.FetchRequest(session_id=self.session_id, key=key, **kw), timeout=TIMEOUT)
        check(not r.meta.HasField("location"), "%s: inline fetch has a location" % key)
        return r.meta, r.inline_data

    def fetch_stream(self, key, session_id=None, **kw):
        sid = self.session_id if session_id is None else session_id
        chunks = self.api.FetchStream(self.pb.FetchRequest(session_id=sid, key=key, **kw), timeout=TIMEOUT)
        first = next(chunks)
        check(first.HasField("header") and not first.data, "%s: first chunk is not a bare header" % key)
        check(len(first.header.tensors) == 1, "%s: header has %d tensors" % (key, len(first.header.tensors)))
        meta = first.header.tensors[0]
        data = []
        for c in chunks:
            check(not c.HasField("header"), "%s: second header" % key)
            data.append(c.data)
        data = b"".join(data)
        check(len(data) == meta.byte_length, "%s: %d bytes streamed, meta says %d" % (key, len(data), meta.byte_length))
        return meta, data

    def send(self, key, dtype, shape, data):
        meta = self.pb.TensorMeta(key=key, dtype=dtype, shape=shape, byte_length=len(data))
        self.api.Send(self.pb.SendRequest(session_id=self.session_id, meta=meta, inline_data=data), timeout=TIMEOUT)

    def send_stream(self, chunks):
        return self.api.SendStream(iter(chunks), timeout=TIMEOUT)

    def call_stream(self, chunks):
        """Sends chunks, half-closes, and returns the reply's header and the
        reply tensors' bytes, split by the header's byte lengths."""
        replies = self.api.CallStream(iter(chunks), timeout=TIMEOUT)
        first = next(replies)
        check(first.HasField("header") and not first.data, "CallStream: first reply chunk is not a bare header")
        data = b"".join(c.data for c in replies)
        h = first.header
        check(len(data) == sum(m.byte_length for m in h.tensors), "CallStream: reply bytes do not add up")
        out, off = [], 0
        for m in h.tensors:
            out.append(data[off:off + m.byte_length])
            off += m.byte_length
        return h, out


def run(pb, addr):
    c = Client(pb, addr)
    c.open_session()
    code = grpc.StatusCode

    # Fetch, inline: small tensors of several dtypes, bit-exact.
    f16 = [(k - 10) * 0.25 for k in range(32)]
    meta, data = c.fetch("small.f16")
    check(meta.dtype == pb.DTYPE_FLOAT16 and list(meta.shape) == [4, 8] and meta.byte_length == 64,
          "small.f16 meta %s" % meta)
    check(data == b"".join(f16_bits(x) for x in f16), "small.f16 bytes differ")
    check(list(struct.unpack("<32e", data)) == f16, "small.f16 values differ")
    bf16 = [(k - 12) * 0.5 for k in range(24)]
    meta, data = c.fetch("small.bf16")
    check(meta.dtype == pb.DTYPE_BFLOAT16 and list(meta.shape) == [2, 3, 4], "small.bf16 meta %s" % meta)
    check(data == b"".join(bf16_bits(x) for x in bf16), "small.bf16 bytes differ")
    meta, data = c.fetch("small.i64")
    check(meta.dtype == pb.DTYPE_INT64 and list(meta.shape) == [2, 3], "small.i64 meta %s" % meta)
    check(list(struct.unpack("<6q", data)) == [(k - 3) * 1000000007 for k in range(6)], "small.i64 values differ")
    meta, data = c.fetch("small.scalar")
    check(meta.dtype == pb.DTYPE_FLOAT64 and list(meta.shape) == [] and data == struct.pack("<d", 2.5),
          "small.scalar: %s %r" % (meta, data))
    print("ok   Fetch inline: float16, bfloat16, int64, float64 scalar")

    # FetchStream of a tensor above the eager threshold, and of an empty one.
    meta, data = c.fetch_stream("big")
    check(meta.dtype == pb.DTYPE_FLOAT32 and list(meta.shape) == [1536, 1024] and meta.key == "big",
          "big meta %s" % meta)
    check(data == big_bytes(), "big: streamed bytes differ")
    meta, data = c.fetch_stream("empty")
    check(meta.dtype == pb.DTYPE_UINT8 and list(meta.shape) == [0, 4] and data == b"", "empty: %s" % meta)
    meta, data = c.fetch_stream("small.f16", session_id="")  # no session needed
    check(len(data) == 64, "FetchStream without a session")
    print("ok   FetchStream: 6 MiB float32, an empty tensor, and without a session")

    # Send inline.
    c.send("py.small", pb.DTYPE_INT32, [5], struct.pack("<5i", -2, -1, 0, 1, 2147483647))
    meta, data = c.fetch("py.small")
    check(struct.unpack("<5i", data) == (-2, -1, 0, 1, 2147483647), "py.small round trip")
    print("ok   Send inline")

    # SendStream of 12 MiB of float32 in chunks of 8 MiB, 777777 bytes and
    # the rest: a chunk need not hold whole elements.
    payload = py_big_bytes()
    meta = pb.TensorMeta(key="py.big", dtype=pb.DTYPE_FLOAT32, shape=[3, MiB], byte_length=len(payload))
    cuts = [0, 8 * MiB, 8 * MiB + 777777, len(payload)]
    chunks = [pb.Chunk(header=pb.ChunkHeader(tensors=[meta]))]
    chunks += [pb.Chunk(data=payload[a:b]) for a, b in zip(cuts, cuts[1:])]
    try:
        c.send_stream(chunks)
    except grpc.RpcError as e:
        if e.code() == code.RESOURCE_EXHAUSTED:
            raise CheckFailed("SendStream with an 8 MiB chunk: %s (%s); the .proto promises chunks up to 16 MiB"
                              % (e.code(), e.details()))
        raise
    meta, data = c.fetch_stream("py.big")
    check(data == payload, "py.big round trip")
    print("ok   SendStream: 12 MiB float32 with an 8 MiB chunk")

    # The largest Chunk the .proto allows (16 MiB of data), and one past the
    # message limit (16 MiB + 64 KiB encoded), which gRPC refuses.
    payload = bytes(range(256)) * (16 * MiB // 256)
    meta = pb.TensorMeta(key="py.max", dtype=pb.DTYPE_UINT8, shape=[len(payload)], byte_length=len(payload))
    c.send_stream([pb.Chunk(header=pb.ChunkHeader(tensors=[meta])), pb.Chunk(data=payload)])
    check(c.fetch_stream("py.max")[1] == payload, "py.max round trip")
    print("ok   SendStream: one 16 MiB chunk")
    over = 16 * MiB + 64 * 1024
    meta = pb.TensorMeta(key="py.over", dtype=pb.DTYPE_UINT8, shape=[over], byte_length=over)
    expect_code(code.RESOURCE_EXHAUSTED,
                lambda: c.send_stream([pb.Chunk(header=pb.ChunkHeader(tensors=[meta])), pb.Chunk(data=bytes(over))]),
                "SendStream with a chunk over the message limit")
    del payload

    # FetchStream with wait: blocks until the key is published.
    got = {}

    def wait_for_later():
        try:
            got["t"] = c.fetch_stream("py.later", wait=True)
        except Exception as e:  # noqa: BLE001
            got["err"] = e

    waiter = threading.Thread(target=wait_for_later)
    waiter.start()
    expect_code(code.NOT_FOUND, lambda: c.fetch("py.later"), "Fetch of py.later before it is published")
    c.send("py.later", pb.DTYPE_UINT8, [3], b"\x01\x02\x03")
    waiter.join(TIMEOUT)
    check("t" in got and got["t"][1] == b"\x01\x02\x03", "FetchStream with wait: %s" % got)
    print("ok   FetchStream with wait")

    # Call, unary, inline: reply tensors carry inline_index.
    x = f32([1.5, -2, 0, 3.25])
    y = bytes([1, 2, 250])
    r = c.api.Call(pb.CallRequest(session_id=c.session_id, method="thirdparty.scale", metadata=b"abc",
                                  tensors=[pb.TensorMeta(dtype=pb.DTYPE_FLOAT32, shape=[4], byte_length=16, inline_index=0),
                                           pb.TensorMeta(dtype=pb.DTYPE_UINT8, shape=[3], byte_length=3, inline_index=1)],
                                  inline_data=[x, y]), timeout=TIMEOUT)
    check(r.metadata == b"cba" and len(r.tensors) == 3, "Call reply %s" % r)
    got_x = r.inline_data[r.tensors[0].inline_index]
    check(got_x == f32([3, -4, 0, 6.5]), "Call: doubled tensor differs")
    check(list(r.tensors[1].shape) == [] and r.inline_data[r.tensors[1].inline_index] == struct.pack("<q", 253),
          "Call: sum differs")
    check(list(r.tensors[2].shape) == [0, 3] and r.tensors[2].byte_length == 0, "Call: empty tensor %s" % r.tensors[2])
    print("ok   Call inline")

    # CallStream: two request tensors in chunks that span them, a reply of
    # three (a doubled 2.4 MiB float32, an int64 scalar, an empty float64).
    n = 2 * 300000
    x = f32([(i % 512) * 0.5 - 64 for i in range(512)]) * (n // 512) + f32([(i % 512) * 0.5 - 64 for i in range(n % 512)])
    y = bytes(i % 251 for i in range(1000))
    body = x + y
    header = pb.ChunkHeader(method="thirdparty.scale", metadata=b"metadata", tensors=[
        pb.TensorMeta(key="x", dtype=pb.DTYPE_FLOAT32, shape=[2, 300000], byte_length=len(x)),
        pb.TensorMeta(key="y", dtype=pb.DTYPE_UINT8, shape=[1000], byte_length=len(y)),
    ])
    step = 1000003
    h, out = c.call_stream([pb.Chunk(header=header)] + [pb.Chunk(data=body[o:o + step]) for o in range(0, len(body), step)])
    check(h.metadata == b"atadatem" and h.method == "", "CallStream reply header %s" % h.metadata)
    check([m.dtype for m in h.tensors] == [pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_FLOAT64], "CallStream reply dtypes")
    check([list(m.shape) for m in h.tensors] == [[2, 300000], [], [0, 3]], "CallStream reply shapes")
    doubled = array.array("f", x)
    for i in range(len(doubled)):
        doubled[i] *= 2
    check(out[0] == doubled.tobytes(), "CallStream: doubled tensor differs")
    check(out[1] == struct.pack("<q", sum(y)) and out[2] == b"", "CallStream: sum or empty tensor differs")
    print("ok   CallStream: 2.4 MiB + 1000 B in, three tensors out")

    # Status codes.
    expect_code(code.NOT_FOUND, lambda: c.fetch("missing"), "Fetch of an unpublished key")
    expect_code(code.NOT_FOUND, lambda: c.fetch_stream("missing"), "FetchStream of an unpublished key")
    expect_code(code.FAILED_PRECONDITION, lambda: c.fetch("big"), "Fetch (unary) above the eager threshold")
    expect_code(code.UNAVAILABLE, lambda: c.fetch_stream("big", session_id="no-such-session"), "FetchStream naming an unknown session")
    bad = pb.TensorMeta(key="bad", dtype=pb.DTYPE_FLOAT32, shape=[4], byte_length=16)
    expect_code(code.INVALID_ARGUMENT, lambda: c.send_stream([pb.Chunk(data=b"x" * 16)]),
                "SendStream without a header")
    expect_code(code.INVALID_ARGUMENT, lambda: c.send_stream([pb.Chunk(header=pb.ChunkHeader(tensors=[bad]), data=b"x" * 16)]),
                "SendStream whose header chunk has data")
    expect_code(code.INVALID_ARGUMENT, lambda: c.send_stream([pb.Chunk(header=pb.ChunkHeader(tensors=[bad])), pb.Chunk(data=b"x" * 15)]),
                "SendStream one byte short")
    expect_code(code.INVALID_ARGUMENT, lambda: c.send_stream([pb.Chunk(header=pb.ChunkHeader(tensors=[bad])), pb.Chunk(data=b"x" * 17)]),
                "SendStream one byte long")
    expect_code(code.INVALID_ARGUMENT, lambda: c.send_stream([pb.Chunk(header=pb.ChunkHeader(tensors=[bad])), pb.Chunk(data=b"x" * 16),
                                                              pb.Chunk(data=b"x")]),
                "SendStream with a chunk past the end")
    wrong = pb.TensorMeta(key="bad", dtype=pb.DTYPE_FLOAT32, shape=[4], byte_length=15)
    expect_code(code.INVALID_ARGUMENT, lambda: c.send_stream([pb.Chunk(header=pb.ChunkHeader(tensors=[wrong])), pb.Chunk(data=b"x" * 15)]),
                "SendStream whose byte_length does not match dtype and shape")
    expect_code(code.INVALID_ARGUMENT, lambda: c.send_stream([pb.Chunk(header=pb.ChunkHeader(tensors=[bad, bad]))]),
                "SendStream with two tensors")
    expect_code(code.INVALID_ARGUMENT, lambda: c.send("bad", pb.DTYPE_INVALID, [1], b"x"), "Send of dtype DTYPE_INVALID")
    expect_code(code.UNIMPLEMENTED, lambda: c.call_stream([pb.Chunk(header=pb.ChunkHeader(method="no.such.method"))]),
                "CallStream of an unknown method")

    # The session ends with its stream; its id is then unknown.
    sid = c.session_id
    c.close_session()
    expect_code(code.UNAVAILABLE, lambda: c.fetch_stream("big", session_id=sid), "FetchStream naming the ended session")
    c.channel.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pb-dir", help="directory holding tensorrpc_pb2.py (default: generate it with protoc)")
    ap.add_argument("addr", help="HOST:PORT of a tensorrpc server set up as rpc/thirdparty_test.go does")
    args = ap.parse_args()
    pb = load_pb2(args.pb_dir)
    try:
        run(pb, args.addr)
    except CheckFailed as e:
        print("FAIL %s" % e, file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print("FAIL unexpected RPC error: %s: %s" % (e.code(), e.details()), file=sys.stderr)
        import traceback
        traceback.print_exc()
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
