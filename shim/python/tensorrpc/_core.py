"""Server and Client over the C ABI."""

import atexit
import ctypes
import threading
import weakref

from . import _lib
from ._lib import lib
from ._tensors import adopt, check_output, describe, dtype_name, _dlpack_dtype
from .errors import Error, FailedPreconditionError, InvalidArgumentError, error

_open = weakref.WeakSet()  # servers and clients to close at exit


@atexit.register
def _close_all():
    # Clients first: their sessions may be with servers of this process.
    objs = list(_open)
    for o in [o for o in objs if isinstance(o, Client)] + [o for o in objs if isinstance(o, Server)]:
        try:
            o.close()
        except Error:
            pass


def _check(code, err):
    """Raises the Error for a non-zero status code, with the message the
    library stored in err."""
    if code != 0:
        raise error(code, _lib.take_string(err.value) or "tensorrpc: error code %d" % code)


def _timeout_ms(timeout):
    if timeout is None:
        return -1
    if timeout < 0:
        raise InvalidArgumentError("timeout must be None or >= 0, not %r" % (timeout,))
    return int(timeout * 1000)


def _key(key, what="key"):
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, bytes):
        raise InvalidArgumentError("%s must be str, not %s" % (what, type(key).__name__))
    return key


def _options(transports, eager_threshold, pool_limit, max_tensor_bytes, connect_timeout, data_address=None):
    o = _lib.Options()
    if transports is not None:
        if isinstance(transports, str):
            transports = [transports]
        o.transports = ",".join(transports).encode()
    o.eager_threshold = eager_threshold or 0
    o.pool_limit = pool_limit or 0
    o.max_tensor_bytes = max_tensor_bytes or 0
    o.connect_timeout_ms = int((connect_timeout or 0) * 1000)
    if data_address:
        o.data_address = _key(data_address, "data_address")
    return o


def _empty(fn, h, shape, dtype, output):
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(d) for d in shape)
    arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    out, err = ctypes.c_void_p(), ctypes.c_void_p()
    _check(fn(h, _dlpack_dtype(dtype_name(dtype)), len(shape), arr, ctypes.byref(out), ctypes.byref(err)), err)
    return adopt(out.value, output)


def _pool_stats(fn, h):
    s, err = _lib.PoolStats(), ctypes.c_void_p()
    _check(fn(h, ctypes.byref(s), ctypes.byref(err)), err)
    return {name: getattr(s, name) for name, _ in s._fields_}


def _stats(fn, h):
    s, err = _lib.Stats(), ctypes.c_void_p()
    _check(fn(h, ctypes.byref(s), ctypes.byref(err)), err)
    return {name: getattr(s, name) for name, _ in s._fields_}


def live_tensors():
    """How many tensors the library has handed out (in this process) that
    are still alive."""
    return lib.trpc_live_tensors()


class Server:
    """A tensorrpc server: a rendezvous of published tensors that clients
    fetch and send to, and methods they call.

    Server(address="127.0.0.1:0") listens at once and serves in background
    threads until close() (or the end of a with block). output says what
    fetch, take, empty and handlers' request tensors are: "numpy", "torch"
    or "tensor" (tensorrpc.Tensor).

    data_address is the address the tcp data plane listens on and
    advertises to clients, "host" (a free port is chosen) or "host:port".
    By default (None) it is the local address of the connection each
    client arrived on, which clients on other hosts can reach; the
    environment variables TENSORRPC_TCP_ADDR and TENSORRPC_SOCKET_IFNAME
    also choose it.
    """

    def __init__(self, address="127.0.0.1:0", *, transports=None, eager_threshold=None,
                 pool_limit=None, max_tensor_bytes=None, connect_timeout=None, data_address=None,
                 output="numpy"):
        self._output = check_output(output)
        self._handlers = []  # every callback ever registered: in-flight calls may use a replaced one
        self._lock = threading.Lock()
        opts = _options(transports, eager_threshold, pool_limit, max_tensor_bytes, connect_timeout, data_address)
        h, err = ctypes.c_uint64(), ctypes.c_void_p()
        _check(lib.trpc_server_new(_key(address, "address"), ctypes.byref(opts), ctypes.byref(h), ctypes.byref(err)), err)
        self._h = h.value
        out = ctypes.c_void_p()
        _check(lib.trpc_server_address(self._h, ctypes.byref(out), ctypes.byref(err)), err)
        self.address = _lib.take_string(out.value)
        _open.add(self)

    def _handle(self):
        h = self._h
        if not h:
            raise FailedPreconditionError("tensorrpc: the server is closed")
        return h

    def publish(self, key, tensor):
        """Publishes a copy of tensor (NumPy array or torch tensor, CPU,
        C-contiguous) under key, replacing what key held. A tensor this
        server handed out (take, empty, a handler's request) is published
        without a copy; do not write it afterwards."""
        d = describe(tensor)
        err = ctypes.c_void_p()
        _check(lib.trpc_server_publish(self._handle(), _key(key), ctypes.byref(d.dl), ctypes.byref(err)), err)

    def unpublish(self, key):
        """Removes key; returns whether it was published."""
        return bool(lib.trpc_server_unpublish(self._handle(), _key(key)))

    def fetch(self, key, *, wait=False, timeout=None, output=None):
        """The tensor published under key (by publish or a client's send).
        It stays published and shares memory with the published tensor.
        A key that is not published raises NotFoundError at once, unless
        wait: then fetch waits for it, up to timeout seconds (None:
        forever; DeadlineExceededError after)."""
        return self._fetch(key, False, wait, timeout, output)

    def take(self, key, *, wait=False, timeout=None, output=None):
        """fetch that also unpublishes key."""
        return self._fetch(key, True, wait, timeout, output)

    def _fetch(self, key, take, wait, timeout, output):
        output = check_output(output or self._output)
        flags = (_lib.FETCH_TAKE if take else 0) | (_lib.FETCH_WAIT if wait else 0)
        out, err = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.trpc_server_fetch(self._handle(), _key(key), flags, _timeout_ms(timeout),
                                     ctypes.byref(out), ctypes.byref(err)), err)
        return adopt(out.value, output)

    def empty(self, shape, dtype, *, output=None):
        """An uninitialised tensor in the server's pool: publishing it or
        returning it from a handler costs no copy."""
        return _empty(lib.trpc_server_empty, self._handle(), shape, dtype, check_output(output or self._output))

    def handle(self, method, fn, *, output=None):
        """Serves method with fn(metadata: bytes, tensors: list) ->
        (metadata, tensors) or None. fn runs on a library thread (several
        may run at once). Its request tensors are zero-copy views that stay
        valid as long as fn's caller keeps them; the reply's tensors are
        copied into the pool before fn's result is returned (no copy for
        tensors this server handed out). An exception in fn fails the call
        with its status code (tensorrpc.Error) or UNKNOWN."""
        output = check_output(output or self._output)
        name = _key(method, "method")
        cb = _lib.HANDLER(_make_handler(fn, output))
        err = ctypes.c_void_p()
        with self._lock:
            _check(lib.trpc_server_handle(self._handle(), name, cb, None, ctypes.byref(err)), err)
            self._handlers.append(cb)  # the library may call it until close() returns

    def pool_stats(self):
        """The server pool's statistics (in_use, allocs, ...)."""
        return _pool_stats(lib.trpc_server_pool_stats, self._handle())

    def stats(self):
        """Transfer statistics over every session (transfers, copies, ...)."""
        return _stats(lib.trpc_server_stats, self._handle())

    def close(self):
        """Stops the server; no handler runs after it returns. Tensors it
        handed out stay valid until released or collected. Returns the
        number of pool buffers still live."""
        with self._lock:
            h, self._h = self._h, 0
        if not h:
            return 0
        n, err = ctypes.c_int64(), ctypes.c_void_p()
        _check(lib.trpc_server_close(h, ctypes.byref(n), ctypes.byref(err)), err)
        self._handlers.clear()
        _open.discard(self)
        return n.value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_h", 0) and lib is not None:
            self.close()

    def __repr__(self):
        return "tensorrpc.Server(%r%s)" % (getattr(self, "address", "?"), "" if self._h else ", closed")


def _make_handler(fn, output):
    def handler(_user, reply, method, meta, meta_len, tensors, n):
        try:
            # Own every request tensor first, so that none leaks on failure.
            owned = [adopt(tensors[i], "tensor") for i in range(n)]
            args = [t if output == "tensor" else (t.numpy() if output == "numpy" else t.torch()) for t in owned]
            if output != "tensor":
                for t in owned:
                    t.release()
            metadata = ctypes.string_at(meta, meta_len) if meta_len else b""
            result = fn(metadata, args)
            del args, owned
            out_meta, out_tensors = (b"", []) if result is None else result
            if isinstance(out_meta, str):
                out_meta = out_meta.encode("utf-8")
            err = ctypes.c_void_p()
            if out_meta:
                _check(lib.trpc_reply_set_metadata(reply, bytes(out_meta), len(out_meta), ctypes.byref(err)), err)
            for i, t in enumerate(out_tensors or ()):
                d = describe(t, "reply tensor %d" % i)
                _check(lib.trpc_reply_add_tensor(reply, ctypes.byref(d.dl), ctypes.byref(err)), err)
            return 0
        except BaseException as e:  # never let an exception cross into Go
            code = e.code if isinstance(e, Error) else 2
            msg = e.message if isinstance(e, Error) else "%s: %s" % (type(e).__name__, e)
            lib.trpc_reply_set_error(reply, msg.encode("utf-8", "replace"))
            return code or 2
    return handler


class Client:
    """A session with a tensorrpc server at address ("host:port").

    The data plane is negotiated (shm > tcp > grpc unless transports says
    otherwise); transport names the one in use. output says what fetch,
    call and empty return: "numpy", "torch" or "tensor" (tensorrpc.Tensor).
    """

    def __init__(self, address, *, transports=None, timeout=30.0, eager_threshold=None,
                 pool_limit=None, max_tensor_bytes=None, connect_timeout=None, output="numpy"):
        self._output = check_output(output)
        self._lock = threading.Lock()
        opts = _options(transports, eager_threshold, pool_limit, max_tensor_bytes, connect_timeout)
        h, err = ctypes.c_uint64(), ctypes.c_void_p()
        _check(lib.trpc_client_dial(_key(address, "address"), ctypes.byref(opts), _timeout_ms(timeout),
                                    ctypes.byref(h), ctypes.byref(err)), err)
        self._h = h.value
        self.address = address
        out = ctypes.c_void_p()
        _check(lib.trpc_client_transport(self._h, ctypes.byref(out), ctypes.byref(err)), err)
        self.transport = _lib.take_string(out.value)
        _open.add(self)

    def _handle(self):
        h = self._h
        if not h:
            raise FailedPreconditionError("tensorrpc: the client is closed")
        return h

    def fetch(self, key, *, lease=False, wait=False, timeout=None, output=None):
        """The tensor the server published under key (or a client sent
        there), taking up to timeout seconds (None: no limit). It is a
        zero-copy view of the client's pool memory, valid until collected.
        With lease (shm only) it is the server's memory itself, mapped
        read-only in spirit: do not write it. A key that is not published
        raises NotFoundError at once, unless wait: then fetch waits for it
        until timeout (DeadlineExceededError)."""
        output = check_output(output or self._output)
        flags = (_lib.FETCH_LEASE if lease else 0) | (_lib.FETCH_WAIT if wait else 0)
        out, err = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.trpc_client_fetch(self._handle(), _key(key), flags, _timeout_ms(timeout),
                                     ctypes.byref(out), ctypes.byref(err)), err)
        return adopt(out.value, output)

    def send(self, key, tensor, *, timeout=None):
        """Puts tensor (NumPy array or torch tensor, CPU, C-contiguous) into
        the server's rendezvous under key. Its memory is read during the
        call only (copied into the pool first, unless it came from empty()
        or fetch())."""
        d = describe(tensor)
        err = ctypes.c_void_p()
        _check(lib.trpc_client_send(self._handle(), _key(key), ctypes.byref(d.dl), _timeout_ms(timeout),
                                    ctypes.byref(err)), err)

    def call(self, method, metadata=b"", tensors=(), *, timeout=None, output=None):
        """Calls method with metadata (bytes) and tensors; returns the
        reply's (metadata, [tensors])."""
        output = check_output(output or self._output)
        if isinstance(metadata, str):
            metadata = metadata.encode("utf-8")
        metadata = bytes(metadata)
        ds = [describe(t, "request tensor %d" % i) for i, t in enumerate(tensors)]
        arr = (_lib.DLTensor * max(len(ds), 1))(*[d.dl for d in ds])
        rmeta, rmeta_len = ctypes.c_void_p(), ctypes.c_int64()
        rtensors, n = ctypes.c_void_p(), ctypes.c_int64()
        err = ctypes.c_void_p()
        _check(lib.trpc_client_call(self._handle(), _key(method, "method"), metadata, len(metadata), arr, len(ds),
                                    _timeout_ms(timeout), ctypes.byref(rmeta), ctypes.byref(rmeta_len),
                                    ctypes.byref(rtensors), ctypes.byref(n), ctypes.byref(err)), err)
        del ds
        try:
            reply_meta = ctypes.string_at(rmeta.value, rmeta_len.value) if rmeta_len.value else b""
            ptrs = ctypes.cast(rtensors, ctypes.POINTER(ctypes.c_void_p))
            owned = [adopt(ptrs[i], "tensor") for i in range(n.value)]
        finally:
            lib.trpc_free(rmeta)
            lib.trpc_free(rtensors)
        if output == "tensor":
            return reply_meta, owned
        out = []
        for t in owned:
            with t:
                out.append(t.numpy() if output == "numpy" else t.torch())
        return reply_meta, out

    def empty(self, shape, dtype, *, output=None):
        """An uninitialised tensor in the client's pool: sending it costs no
        copy from caller memory."""
        return _empty(lib.trpc_client_empty, self._handle(), shape, dtype, check_output(output or self._output))

    def pool_stats(self):
        """The client pool's statistics (in_use, allocs, ...)."""
        return _pool_stats(lib.trpc_client_pool_stats, self._handle())

    def stats(self):
        """The session's transfer statistics (transfers, copies, leases, ...)."""
        return _stats(lib.trpc_client_stats, self._handle())

    def close(self):
        """Ends the session. Tensors received stay valid until released or
        collected. Returns the number of pool buffers still live."""
        with self._lock:
            h, self._h = self._h, 0
        if not h:
            return 0
        n, err = ctypes.c_int64(), ctypes.c_void_p()
        _open.discard(self)
        _check(lib.trpc_client_close(h, ctypes.byref(n), ctypes.byref(err)), err)
        return n.value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_h", 0) and lib is not None:
            self.close()

    def __repr__(self):
        return "tensorrpc.Client(%r, transport=%r%s)" % (
            self.address, getattr(self, "transport", "?"), "" if self._h else ", closed")
