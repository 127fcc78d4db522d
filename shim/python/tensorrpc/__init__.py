"""tensorrpc for Python: move NumPy arrays, PyTorch tensors and buffers
between processes through tensorrpc, without copying them in Python.

    import tensorrpc
    with tensorrpc.Server() as srv:               # listens on 127.0.0.1:<free port>
        srv.publish("weights", w)                 # a NumPy array or torch tensor
        srv.publish("cache", kv, writable=True)   # clients may write rows of it
        with tensorrpc.Client(srv.address) as c:
            x = c.fetch("weights")                # zero-copy view of pool memory
            c.send("grad", g)
            meta, outs = c.call("scale", b"2", [x])
            c.fetch("cache", rows=[7, 2], out=mine)  # rows 7 and 2, into an array of yours
            c.send_rows("cache", [7, 2], mine)    # and back over them

The package is a ctypes binding of libtensorrpc.so (shim/capi); see
shim/README.md. NumPy and PyTorch are optional (extras "numpy", "torch"):
without them, bytes and buffers go in and tensorrpc.Tensor objects come out
(output="tensor").
"""

from ._version import __version__
from ._core import Client, HandlerFn, HandlerResult, Server, cuda_device_count, device_memory_stats, live_tensors
from ._lib import library_path
from ._tensors import DTYPES, Tensor
from .errors import (CODES, DeadlineExceededError, Error, FailedPreconditionError, InvalidArgumentError,
                     NotFoundError, PermissionDeniedError, ResourceExhaustedError, UnavailableError,
                     UnimplementedError)

__all__ = [
    "__version__", "HandlerFn", "HandlerResult", "Server", "Client", "Tensor", "Error", "InvalidArgumentError", "DeadlineExceededError", "NotFoundError",
    "PermissionDeniedError", "ResourceExhaustedError", "FailedPreconditionError", "UnimplementedError", "UnavailableError",
    "CODES", "DTYPES", "live_tensors", "library_path", "cuda_device_count", "device_memory_stats",
]
