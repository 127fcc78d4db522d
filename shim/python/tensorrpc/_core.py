"""Server and Client over the C ABI."""

import atexit
import ctypes
import logging
import threading
import traceback
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _lib
from ._lib import lib
from ._tensors import (Tensor, _Consumed, _Described, _dlpack_dtype, _ready_outputs, adopt, check_output, describe,
                       dtype_name, need_output, out_fingerprint, row_indices)
from .errors import Error, FailedPreconditionError, InvalidArgumentError, error

_open: "weakref.WeakSet[Any]" = weakref.WeakSet()  # servers and clients to close at exit

# The logger of handler exceptions ("tensorrpc", at ERROR, with the
# traceback). Without logging configured, Python's last-resort handler
# prints them to stderr.
log = logging.getLogger("tensorrpc")

# What a handler returns: (metadata, tensors) or None.
HandlerResult = Optional[Tuple[Union[bytes, bytearray, memoryview, str], Sequence[Any]]]
HandlerFn = Callable[[bytes, List[Any]], HandlerResult]
Transports = Union[str, Iterable[str], None]


@atexit.register
def _close_all() -> None:
    # Clients first: their sessions may be with servers of this process.
    objs = list(_open)
    for o in [o for o in objs if isinstance(o, Client)] + [o for o in objs if isinstance(o, Server)]:
        try:
            o.close()
        except Error:
            pass


def _check(code: int, err: ctypes.c_void_p) -> None:
    """Raises the Error for a non-zero status code, with the message the
    library stored in err and the details of the failure (on this thread)."""
    if code != 0:
        _raise(code, err.value)


def _raise(code: int, err: Optional[int]) -> None:
    """Raises the Error for status code code, with the message the library
    malloc'd at err and the details of the failure (on this thread)."""
    details = _lib.error_details()
    raise error(code, _lib.take_string(err) or "tensorrpc: error code %d" % code, details)


def _raise_last() -> None:
    """Raises the Error of the last failure on this thread of a function
    that returns NULL on failure (trpc_last_error)."""
    err = ctypes.c_void_p()
    code = lib.trpc_last_error(ctypes.byref(err))
    _raise(code or 2, err.value)  # 2: UNKNOWN, should the library have said nothing


# A call's two results, the tensor and the error message: one object, where
# two c_void_p and their byrefs cost a call twice as much (a 4 KiB fetch's
# hot path).
_Results = ctypes.c_void_p * 2
_SECOND = ctypes.sizeof(ctypes.c_void_p)


_CANCELLED, _DEADLINE_EXCEEDED = 1, 4  # status codes after which a read may still be landing


def _timeout_ms(timeout: Optional[float]) -> int:
    if timeout is None:
        return -1
    if timeout < 0:
        raise InvalidArgumentError("timeout must be None or >= 0, not %r" % (timeout,))
    return int(timeout * 1000)


def _key(key: Union[str, bytes], what: str = "key") -> bytes:
    if type(key) is str:  # the common case first: a call's hot path
        return key.encode()
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, bytes):
        raise InvalidArgumentError("%s must be str, not %s" % (what, type(key).__name__))
    return key


def _options(transports: Transports, eager_threshold: Optional[int], pool_limit: Optional[int],
             max_tensor_bytes: Optional[int], connect_timeout: Optional[float],
             data_address: Optional[str] = None) -> _lib.Options:
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


def _empty(fn: Any, h: int, shape: Union[int, Sequence[int]], dtype: Any, output: str) -> Any:
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(d) for d in shape)
    arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    out, err = ctypes.c_void_p(), ctypes.c_void_p()
    _check(fn(h, _dlpack_dtype(dtype_name(dtype)), len(shape), arr, ctypes.byref(out), ctypes.byref(err)), err)
    return adopt(out.value, output)


def _pool_stats(fn: Any, h: int) -> Dict[str, int]:
    s, err = _lib.PoolStats(), ctypes.c_void_p()
    _check(fn(h, ctypes.byref(s), ctypes.byref(err)), err)
    return {name: getattr(s, name) for name, _ in s._fields_}


def _stats(fn: Any, h: int) -> Dict[str, int]:
    s, err = _lib.Stats(), ctypes.c_void_p()
    _check(fn(h, ctypes.byref(s), ctypes.byref(err)), err)
    return {name: getattr(s, name) for name, _ in s._fields_}


def _parse_device(device: Any) -> Tuple[int, int]:
    """device ("cpu", "cuda", "cuda:N", a torch.device, or an int N for
    cuda:N) as a DLPack (device_type, device_id)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return (_lib.KDLCUDA, device)
    text = str(device)
    if text == "cpu":
        return (_lib.KDLCPU, 0)
    if text == "cuda":
        return (_lib.KDLCUDA, 0)
    if text.startswith("cuda:") and text[5:].isdigit():
        return (_lib.KDLCUDA, int(text[5:]))
    raise InvalidArgumentError("device must be 'cpu', 'cuda' or 'cuda:N', not %r" % (device,))


def cuda_device_count() -> int:
    """Loads the CUDA driver the library uses for CUDA tensors (from
    $TENSORRPC_CUDA_LIBRARY, else libcuda.so.1) and returns how many devices
    it lists. Without a driver: FailedPreconditionError ("no CUDA driver
    ...")."""
    n, err = ctypes.c_int32(), ctypes.c_void_p()
    _check(lib.trpc_cuda_device_count(ctypes.byref(n), ctypes.byref(err)), err)
    return n.value


def device_memory_stats(device: Any = "cuda:0") -> Dict[str, int]:
    """The library's memory on a CUDA device: tensors fetched onto it and
    still alive ("buffers", "bytes") and the device allocations they are
    carved from ("arenas", "arena_bytes"; one empty arena per device is kept
    for the next fetch)."""
    dev_type, dev_id = _parse_device(device)
    s, err = _lib.DeviceMemStats(), ctypes.c_void_p()
    _check(lib.trpc_device_stats(_lib.DLDevice(dev_type, dev_id), ctypes.byref(s), ctypes.byref(err)), err)
    return {name: getattr(s, name) for name, _ in s._fields_}


def live_tensors() -> int:
    """How many tensors the library has handed out (in this process) that
    are still alive."""
    return int(lib.trpc_live_tensors())


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

    address: str

    def __init__(self, address: str = "127.0.0.1:0", *, transports: Transports = None,
                 eager_threshold: Optional[int] = None, pool_limit: Optional[int] = None,
                 max_tensor_bytes: Optional[int] = None, connect_timeout: Optional[float] = None,
                 data_address: Optional[str] = None, output: str = "numpy") -> None:
        self._h = 0
        self._output = check_output(output)
        self._handlers: List[Any] = []  # every callback ever registered: in-flight calls may use a replaced one
        self._lock = threading.Lock()
        opts = _options(transports, eager_threshold, pool_limit, max_tensor_bytes, connect_timeout, data_address)
        h, err = ctypes.c_uint64(), ctypes.c_void_p()
        _check(lib.trpc_server_new(_key(address, "address"), ctypes.byref(opts), ctypes.byref(h), ctypes.byref(err)), err)
        self._h = h.value
        out = ctypes.c_void_p()
        _check(lib.trpc_server_address(self._h, ctypes.byref(out), ctypes.byref(err)), err)
        self.address = _lib.take_string(out.value)
        _open.add(self)

    def _handle(self) -> int:
        h = self._h
        if not h:
            raise FailedPreconditionError("tensorrpc: the server is closed")
        return h

    def publish(self, key: str, tensor: Any, *, writable: bool = False) -> None:
        """Publishes a copy of tensor (NumPy array or torch tensor, CPU,
        C-contiguous) under key, replacing what key held. A tensor this
        server handed out (take, empty, a handler's request) is published
        without a copy; do not write it afterwards, unless it is meant as
        shared state (a writable cache).

        With writable, clients may write rows of it (Client.send_rows; it
        needs at least one dimension); without, their send_rows raises
        PermissionDeniedError. The rows land in the published pool memory:
        publish a tensor from empty() to see them in it (fetch(key) returns
        a view of that memory too).

        A CUDA tensor (any DLPack producer on kDLCUDA) on a server whose
        library has the CUDA driver is kept on its device, not copied:
        clients in other processes of the same host fetch it over CUDA IPC,
        device to device; others (this process too) get it staged.
        The server holds the producer's DLPack tensor (a reference to its
        memory) until the key is replaced, unpublished or taken, or the
        server closes: do not write the tensor while it is published (as
        with torch's own CUDA IPC sharing). writable=True stages it into
        the pool instead. Without a CUDA driver it is staged into the pool
        (one device-to-host copy)."""
        d = describe(tensor)
        err = ctypes.c_void_p()
        flags = _lib.PUBLISH_WRITABLE if writable else 0
        if d.dl.device.device_type == _lib.KDLCUDA:
            # Kept on the device where the server has CUDA: the library
            # calls the producer's deleter once the publish ends.
            owner = next((k for k in d.keep if isinstance(k, _Consumed)), None) \
                if isinstance(d.keep, tuple) else None
            addr, deleter = (owner.addr, owner.deleter) if owner is not None else (None, None)
            h = self._handle()
            if owner is not None:
                owner.deleter = None  # the library's to call from now on
            _check(lib.trpc_server_publish_device(h, _key(key), ctypes.byref(d.dl), deleter, addr, flags,
                                                  ctypes.byref(err)), err)
            return
        _check(lib.trpc_server_publish_flags(self._handle(), _key(key), ctypes.byref(d.dl), flags,
                                             ctypes.byref(err)), err)

    def unpublish(self, key: str) -> bool:
        """Removes key; returns whether it was published."""
        return bool(lib.trpc_server_unpublish(self._handle(), _key(key)))

    def fetch(self, key: str, *, wait: bool = False, timeout: Optional[float] = None,
              output: Optional[str] = None) -> Any:
        """The tensor published under key (by publish or a client's send).
        It stays published and shares memory with the published tensor.
        A key that is not published raises NotFoundError at once, unless
        wait: then fetch waits for it, up to timeout seconds (None:
        forever; DeadlineExceededError after)."""
        return self._fetch(key, False, wait, timeout, output)

    def take(self, key: str, *, wait: bool = False, timeout: Optional[float] = None,
             output: Optional[str] = None) -> Any:
        """fetch that also unpublishes key."""
        return self._fetch(key, True, wait, timeout, output)

    def _fetch(self, key: str, take: bool, wait: bool, timeout: Optional[float], output: Optional[str]) -> Any:
        output = need_output(output or self._output)
        flags = (_lib.FETCH_TAKE if take else 0) | (_lib.FETCH_WAIT if wait else 0)
        out, err = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.trpc_server_fetch(self._handle(), _key(key), flags, _timeout_ms(timeout),
                                     ctypes.byref(out), ctypes.byref(err)), err)
        return adopt(out.value, output)

    def empty(self, shape: Union[int, Sequence[int]], dtype: Any, *, output: Optional[str] = None) -> Any:
        """An uninitialised tensor in the server's pool: publishing it or
        returning it from a handler costs no copy."""
        return _empty(lib.trpc_server_empty, self._handle(), shape, dtype, need_output(output or self._output))

    def handle(self, method: str, fn: HandlerFn, *, output: Optional[str] = None) -> None:
        """Serves method with fn(metadata: bytes, tensors: list) ->
        (metadata, tensors) or None. fn runs on a library thread (several
        may run at once). Its request tensors are zero-copy views that stay
        valid as long as fn's caller keeps them; the reply's tensors are
        copied into the pool before fn's result is returned (no copy for
        tensors this server handed out). An exception in fn fails the call
        with its status code (tensorrpc.Error) or UNKNOWN and the message
        "ExceptionType: text"; its traceback is logged (logger "tensorrpc",
        ERROR) and travels to the client in the error's details
        (tensorrpc.Error.details)."""
        output = need_output(output or self._output)
        name = _key(method, "method")
        cb = _lib.HANDLER(_make_handler(name.decode("utf-8", "replace"), fn, output))
        err = ctypes.c_void_p()
        with self._lock:
            _check(lib.trpc_server_handle(self._handle(), name, cb, None, ctypes.byref(err)), err)
            self._handlers.append(cb)  # the library may call it until close() returns

    def pool_stats(self) -> Dict[str, int]:
        """The server pool's statistics (in_use, allocs, ...)."""
        return _pool_stats(lib.trpc_server_pool_stats, self._handle())

    def stats(self) -> Dict[str, int]:
        """Transfer statistics over every session (transfers, copies, ...)."""
        return _stats(lib.trpc_server_stats, self._handle())

    def close(self) -> int:
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

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_h", 0) and lib is not None:
            self.close()

    def __repr__(self) -> str:
        return "tensorrpc.Server(%r%s)" % (getattr(self, "address", "?"), "" if self._h else ", closed")


def _make_handler(method_name: str, fn: HandlerFn, output: str) -> Callable[..., int]:
    def handler(_user: Any, reply: int, method: bytes, meta: Optional[int], meta_len: int, tensors: Any,
                n: int) -> int:
        try:
            # Own every request tensor first, so that none leaks on failure.
            owned = [adopt(tensors[i], "tensor") for i in range(n)]
            args = [t if output == "tensor" else (t.numpy() if output == "numpy" else t.torch()) for t in owned]
            if output != "tensor":
                for t in owned:
                    t.release()
            metadata = ctypes.string_at(meta, meta_len) if meta and meta_len else b""
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
            try:
                tb = traceback.format_exc()
                log.error("tensorrpc: handler for %r failed:\n%s", method_name, tb.rstrip("\n"))
                lib.trpc_reply_set_error_details(reply, tb.encode("utf-8", "replace"))
            except BaseException:  # a broken logging handler must not cross into Go either
                pass
            lib.trpc_reply_set_error(reply, msg.encode("utf-8", "replace"))
            return code or 2
    return handler


class Client:
    """A session with a tensorrpc server at address ("host:port").

    The data plane is negotiated (shm > tcp > grpc unless transports says
    otherwise); transport names the one in use. output says what fetch,
    call and empty return: "numpy", "torch" or "tensor" (tensorrpc.Tensor).
    """

    transport: str

    def __init__(self, address: str, *, transports: Transports = None, timeout: Optional[float] = 30.0,
                 eager_threshold: Optional[int] = None, pool_limit: Optional[int] = None,
                 max_tensor_bytes: Optional[int] = None, connect_timeout: Optional[float] = None,
                 output: str = "numpy") -> None:
        self._h = 0
        self._output = check_output(output)
        self._lock = threading.Lock()
        # The out arrays of fetches that timed out or were cancelled, kept
        # alive until close(): a Read under way may still land in them
        # (see fetch), and must not land in freed memory.
        self._late_outs: List[Any] = []
        # The last out of fetch(out=...), described: (its id, its
        # fingerprint, its DLTensor, the DLTensor's shape array).
        # A framework refreshing its own tensors passes the same ones
        # again and again; describing one again costs a 4 KiB fetch 20-40%.
        self._out_memo: Optional[Tuple[Any, Any, Any, Any]] = None
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

    def _handle(self) -> int:
        h = self._h
        if not h:
            raise FailedPreconditionError("tensorrpc: the client is closed")
        return h

    def fetch(self, key: str, *, out: Any = None, rows: Optional[Sequence[int]] = None, lease: bool = False,
              wait: bool = False, timeout: Optional[float] = None, output: Optional[str] = None,
              device: Any = None) -> Any:
        """The tensor the server published under key (or a client sent
        there), taking up to timeout seconds (None: no limit). It is a
        zero-copy view of the client's pool memory, valid until collected.
        With lease (shm only) it is the server's memory itself, read-only:
        NumPy arrays of it are not writable, a tensorrpc.Tensor says
        readonly, and its DLPack 1.0 capsules carry the read-only flag. A
        key that is not published raises NotFoundError at once, unless wait:
        then fetch waits for it until timeout (DeadlineExceededError).

        rows (a sequence of ints, or a 1-D integer NumPy array or torch
        tensor) fetches only those rows, indices along dimension 0, in
        that order (repeats allowed), in one request: the result has shape
        (len(rows), *shape[1:]). An index out of range raises
        InvalidArgumentError and nothing moves.

        out (a NumPy array, a CPU torch tensor, a tensorrpc.Tensor or a
        writable buffer; C-contiguous and writable) receives the bytes in
        place and is returned itself (output is ignored): its dtype and
        shape must be exactly those of what arrives, else
        InvalidArgumentError and out is not written. On tcp the bytes go
        straight into out (a whole tensor of up to 4 MiB the server writes
        there before it answers, in one round trip; larger ones and rows
        are read there), on shm too; on grpc, and for tensors small
        enough to come inline, they are copied into it once
        (stats()["copies"]). If fetch fails otherwise, out's contents are
        undefined; when it returns, whatever its result, nothing writes
        out any more (a read under way is waited for). After a timeout or
        a cancellation the client still keeps out alive until close(), a
        belt-and-braces reference that costs nothing.
        lease cannot be combined with out.

        device ("cuda", "cuda:N", a torch.device; None or "cpu": host
        memory) fetches the tensor onto that CUDA device: the result is
        device memory the library allocated for it (freed when the result
        is collected), its bytes complete on the device when fetch returns.
        output="torch" gives a torch CUDA tensor (torch.from_dlpack; it
        needs a CUDA build of PyTorch), "tensor" a tensorrpc.Tensor whose
        __dlpack_device__() is (2, N); NumPy arrays cannot hold device
        memory, so a client whose output is "numpy" returns torch tensors
        here unless output says otherwise. out, rows and lease do not
        combine with device. Today the tensor is staged: fetched into host
        memory and copied onto the device."""
        flags = (_lib.FETCH_LEASE if lease else 0) | (_lib.FETCH_WAIT if wait else 0)
        if out is None and rows is None and device is None:  # the common case, first
            # A call's hot path, written out: each Python call, ctypes
            # object and out-parameter costs a 4 KiB shm fetch (about 15
            # µs) a few percent (bench_latency.py: py-tensor against py-raw).
            output = output or self._output
            if output not in _ready_outputs:
                output = need_output(output)
            h = self._h
            if not h:
                raise FailedPreconditionError("tensorrpc: the client is closed")
            m = lib.trpc_client_fetch_tensor(h, key.encode() if type(key) is str else _key(key), flags,
                                             -1 if timeout is None else _timeout_ms(timeout))
            if not m:
                _raise_last()
            if output == "tensor":
                return Tensor(m)  # adopt's first case, without its call
            return adopt(m, output, False if not lease else None)  # only a lease is read-only
        err = ctypes.c_void_p()
        dev = _parse_device(device) if device is not None else (_lib.KDLCPU, 0)
        if dev[0] != _lib.KDLCPU:
            if out is not None or rows is not None or lease:
                raise InvalidArgumentError("fetch: device=%r does not combine with out, rows or lease" % (device,))
            if output is None:
                output = "torch" if self._output == "numpy" else self._output
            if output == "numpy":
                raise InvalidArgumentError("fetch: NumPy arrays cannot hold CUDA memory; "
                                           "use output='torch' or 'tensor' with device=%r" % (device,))
            output = need_output(output)
            got = ctypes.c_void_p()
            _check(lib.trpc_client_fetch_device(self._handle(), _key(key), _lib.DLDevice(*dev), flags,
                                                _timeout_ms(timeout), ctypes.byref(got), ctypes.byref(err)), err)
            return adopt(got.value, output)
        if out is not None:
            if lease:
                raise InvalidArgumentError("fetch: lease and out exclude each other (a lease is the server's memory)")
            d = self._described_out(out)
            idx: Any = None
            n = 0
            if rows is not None:
                idx, n, keep = row_indices(rows)
                if n == 0:
                    raise InvalidArgumentError("fetch: rows names no row")
            code = lib.trpc_client_fetch_into(self._handle(), _key(key), ctypes.byref(d.dl), idx, n, flags,
                                              _timeout_ms(timeout), ctypes.byref(err))
            if code in (_CANCELLED, _DEADLINE_EXCEEDED):
                with self._lock:
                    self._late_outs.append(d)  # its memory, until close()
            _check(code, err)
            return out
        output = need_output(output or self._output)
        got = ctypes.c_void_p()
        if rows is not None:
            idx, n, keep = row_indices(rows)
            _check(lib.trpc_client_fetch_rows(self._handle(), _key(key), idx, n, flags, _timeout_ms(timeout),
                                              ctypes.byref(got), ctypes.byref(err)), err)
            del keep
            return adopt(got.value, output)
        _check(lib.trpc_client_fetch(self._handle(), _key(key), flags, _timeout_ms(timeout),
                                     ctypes.byref(got), ctypes.byref(err)), err)
        return adopt(got.value, output)

    def _described_out(self, out: Any) -> Any:
        """describe(out, "out", writable=True), or what it gave for the
        same object the last time while out's fingerprint is unchanged.
        No reference to out is kept (a weak one would stop NumPy's
        resize): should another object take out's id later, an equal
        fingerprint still means an equal description."""
        fp = out_fingerprint(out)
        memo = self._out_memo
        if memo is not None and fp is not None and memo[0] == id(out) and memo[1] == fp:
            return _Described.again(memo[2], out, memo[3])
        d = describe(out, "out", writable=True)
        if fp is not None:
            self._out_memo = (id(out), fp, d.dl, d.keep[1])
        return d

    def send(self, key: str, tensor: Any, *, timeout: Optional[float] = None) -> None:
        """Puts tensor (NumPy array or torch tensor, CPU, C-contiguous) into
        the server's rendezvous under key. Its memory is read during the
        call only: on tcp in place (no copy: stats()["copies"] stays put);
        on shm and grpc it is copied into the pool once first, unless it
        came from empty() or fetch(). A CUDA tensor (torch, CuPy, JAX: any
        DLPack producer whose __dlpack_device__() is (2, N)) is asked for
        with __dlpack__(stream=1) and staged through a pool buffer (one
        device-to-host copy)."""
        d = describe(tensor)
        err = ctypes.c_void_p()
        if d.dl.device.device_type == _lib.KDLCUDA:
            # Made ready on the legacy default stream by describe (DLPack).
            _check(lib.trpc_client_send_device(self._handle(), _key(key), ctypes.byref(d.dl), _lib.STREAM_LEGACY,
                                               _timeout_ms(timeout), ctypes.byref(err)), err)
            return
        _check(lib.trpc_client_send(self._handle(), _key(key), ctypes.byref(d.dl), _timeout_ms(timeout),
                                    ctypes.byref(err)), err)

    def send_rows(self, key: str, rows: Sequence[int], tensor: Any, *, timeout: Optional[float] = None) -> None:
        """Writes tensor's rows over rows (distinct indices along dimension
        0: a sequence of ints, or a 1-D integer array) of the tensor the
        server published under key with writable=True, in one request.
        tensor (as for send) has shape (len(rows), *shape[1:]) of the
        published tensor, and its dtype; its memory is read during the call
        only, on tcp in place. Not writable: PermissionDeniedError; not
        published: NotFoundError; a bad row, shape or dtype:
        InvalidArgumentError; nothing is written on an error. Writes of
        different rows by different clients do not interfere; fetches that
        start after send_rows returns see them."""
        d = describe(tensor)
        idx, n, keep = row_indices(rows)
        err = ctypes.c_void_p()
        _check(lib.trpc_client_send_rows(self._handle(), _key(key), idx, n, ctypes.byref(d.dl),
                                         _timeout_ms(timeout), ctypes.byref(err)), err)
        del keep

    def call(self, method: str, metadata: Union[bytes, bytearray, memoryview, str] = b"",
             tensors: Sequence[Any] = (), *, timeout: Optional[float] = None,
             output: Optional[str] = None) -> Tuple[bytes, List[Any]]:
        """Calls method with metadata (bytes) and tensors; returns the
        reply's (metadata, [tensors]). A handler's failure raises the Error
        of its status code; its details carry the handler's traceback."""
        output = need_output(output or self._output)
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
            reply_meta = ctypes.string_at(rmeta.value, rmeta_len.value) if rmeta.value and rmeta_len.value else b""
            ptrs = ctypes.cast(rtensors, ctypes.POINTER(ctypes.c_void_p))
            owned = [adopt(ptrs[i], "tensor") for i in range(n.value)]
        finally:
            lib.trpc_free(rmeta)
            lib.trpc_free(rtensors)
        if output == "tensor":
            return reply_meta, owned
        # Each array or torch tensor takes its Tensor's reference over.
        return reply_meta, [t._to_numpy(True) if output == "numpy" else t._to_torch(True) for t in owned]

    def empty(self, shape: Union[int, Sequence[int]], dtype: Any, *, output: Optional[str] = None) -> Any:
        """An uninitialised tensor in the client's pool: sending it costs no
        copy from caller memory."""
        return _empty(lib.trpc_client_empty, self._handle(), shape, dtype, need_output(output or self._output))

    def pool_stats(self) -> Dict[str, int]:
        """The client pool's statistics (in_use, allocs, ...)."""
        return _pool_stats(lib.trpc_client_pool_stats, self._handle())

    def stats(self) -> Dict[str, int]:
        """The session's transfer statistics (transfers, copies, leases, ...)."""
        return _stats(lib.trpc_client_stats, self._handle())

    def close(self) -> int:
        """Ends the session. Tensors received stay valid until released or
        collected. Returns the number of pool buffers still live."""
        with self._lock:
            h, self._h = self._h, 0
        if not h:
            return 0
        n, err = ctypes.c_int64(), ctypes.c_void_p()
        _open.discard(self)
        try:
            _check(lib.trpc_client_close(h, ctypes.byref(n), ctypes.byref(err)), err)
        finally:
            with self._lock:
                self._late_outs.clear()  # the session's reads have ended
        return n.value

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_h", 0) and lib is not None:
            self.close()

    def __repr__(self) -> str:
        return "tensorrpc.Client(%r, transport=%r%s)" % (
            self.address, getattr(self, "transport", "?"), "" if self._h else ", closed")
