"""DLPack 1.0 and the legacy protocol, both ways: Tensor.__dlpack__ hands a
"dltensor_versioned" capsule (DLManagedTensorVersioned, read-only flag for
leases) to a consumer that passes max_version >= (1, 0) and a legacy
"dltensor" capsule otherwise (NumPy 1.24 and torch 1.13 are such
consumers); sending accepts producers of either kind (NumPy and torch
tensors through __dlpack__ too, and hand-made producers of both)."""

import ctypes
import gc
import unittest

import numpy as np

import _need
import tensorrpc
from tensorrpc import _lib

SHAPE = (4, 25000)  # over the eager threshold: a shm lease is a lease

# A capsule destructor receives the capsule as a borrowed PyObject*.
_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_is_valid_raw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_get_pointer_raw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def capsule_name(cap):
    return _lib.capsule_get_name(cap)


def consume_versioned(cap):
    """What a DLPack 1.0 consumer does: take the tensor over (rename the
    capsule) and return it; call deleter_of(m) when done."""
    p = _lib.capsule_get_pointer(cap, b"dltensor_versioned")
    assert _lib.capsule_set_name(cap, b"used_dltensor_versioned") == 0
    return _lib.DLManagedTensorVersioned.from_address(p)


def delete_versioned(m):
    m.deleter(ctypes.pointer(m))


class HandMadeProducer:
    """A DLPack producer written against the protocol, in ctypes: versioned
    answers __dlpack__(max_version=...) with a DLPack 1.0 capsule (and
    without max_version with a legacy one, as the protocol says); legacy
    knows only __dlpack__(stream=None), as DLPack < 1.0 producers do.
    deleted counts the deleter calls of the tensors it made."""

    _NAMES = {True: b"dltensor_versioned", False: b"dltensor"}

    def __init__(self, data, versioned, major=1, strides=None):
        self.data = data  # a bytearray: the memory
        self.buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        self.shape = (ctypes.c_int64 * 2)(2, len(data) // 8)
        self.strides = (ctypes.c_int64 * 2)(*strides) if strides else None
        self.versioned = versioned
        self.major = major
        self.deleted = 0
        self.made = []  # structs and callbacks, kept alive
        if versioned:
            self.__dlpack__ = self._dlpack_versioned
        else:
            self.__dlpack__ = self._dlpack_legacy

    def _dltensor(self, dl):
        dl.data = ctypes.addressof(self.buf)
        dl.device = _lib.DLDevice(1, 0)
        dl.ndim = 2
        dl.dtype = _lib.DLDataType(2, 32, 1)  # float32
        dl.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        dl.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64)) if self.strides else None
        dl.byte_offset = 0

    def _capsule(self, m, versioned):
        name = self._NAMES[versioned]

        def destructor(cap):  # deletes an unconsumed tensor
            if _is_valid_raw(cap, name):
                p = _get_pointer_raw(cap, name)
                s = (_lib.DLManagedTensorVersioned if versioned else _lib.DLManagedTensor).from_address(p)
                s.deleter(ctypes.pointer(s))
        d = _DESTRUCTOR(destructor)
        self.made.append(d)
        return _capsule_new(ctypes.addressof(m), name, ctypes.cast(d, ctypes.c_void_p))

    def _new(self, versioned):
        cls = _lib.DLManagedTensorVersioned if versioned else _lib.DLManagedTensor
        m = cls()
        if versioned:
            m.version = _lib.DLPackVersion(self.major, 0)
            m.flags = 0

        def deleter(_p):
            self.deleted += 1
        d = type(m.deleter)(deleter)
        m.deleter = d
        self._dltensor(m.dl_tensor)
        self.made += [m, d]
        return m

    def _dlpack_versioned(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        versioned = max_version is not None and max_version[0] >= 1
        return self._capsule(self._new(versioned), versioned)

    def _dlpack_legacy(self, stream=None):
        return self._capsule(self._new(False), False)

    def __dlpack_device__(self):
        return (1, 0)


class Forward:
    """Passes __dlpack__ on to another producer (a Tensor), so that
    describe() sees a foreign DLPack 1.0 producer."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return (1, 0)


class DLPackTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.srv = tensorrpc.Server()
        cls.c = tensorrpc.Client(cls.srv.address, transports=["shm"])
        cls.want = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
        cls.srv.publish("k", cls.want)

    @classmethod
    def tearDownClass(cls):
        cls.srv.unpublish("k")
        cls.c.close()
        cls.srv.close()

    def setUp(self):
        gc.collect()
        self.live = tensorrpc.live_tensors()

    def tearDown(self):
        gc.collect()
        self.assertEqual(tensorrpc.live_tensors(), self.live, "tensors handed out and never released")

    # --- export ----------------------------------------------------------

    def test_export_versioned(self):
        with self.c.fetch("k", output="tensor") as t:
            self.assertFalse(t.readonly)
            cap = t.__dlpack__(max_version=(1, 0))
            self.assertEqual(capsule_name(cap), b"dltensor_versioned")
            m = consume_versioned(cap)
            self.assertEqual((m.version.major, m.version.minor), (1, 0))
            self.assertEqual(m.flags, 0)
            self.assertEqual(m.dl_tensor.data, t.data_ptr)
            self.assertEqual([m.dl_tensor.shape[i] for i in range(m.dl_tensor.ndim)], list(SHAPE))
            self.assertEqual((m.dl_tensor.dtype.code, m.dl_tensor.dtype.bits), (2, 32))
            del cap
            gc.collect()
            self.assertEqual(tensorrpc.live_tensors(), self.live + 1)  # the consumer holds it
            t.release()
            self.assertEqual(ctypes.string_at(m.dl_tensor.data, 8), self.want.tobytes()[:8])  # still valid
            delete_versioned(m)
        # A newer consumer (max_version 1.3, or 2.0) still gets 1.0.
        with self.c.fetch("k", output="tensor") as t:
            for mv in ((1, 3), (2, 0)):
                cap = t.__dlpack__(max_version=mv)
                self.assertEqual(capsule_name(cap), b"dltensor_versioned")
        # An unconsumed capsule gives its reference back when collected.

    def test_export_legacy(self):
        with self.c.fetch("k", output="tensor") as t:
            for kw in ({}, {"stream": None}, {"max_version": None}, {"max_version": (0, 8)}):
                with self.subTest(kw=kw):
                    self.assertEqual(capsule_name(t.__dlpack__(**kw)), b"dltensor")
            # NumPy 1.24's from_dlpack is a legacy consumer.
            a = np.from_dlpack(t)
        self.assertTrue((a == self.want).all())

    def test_torch_consumer(self):
        torch = _need.module(self, "torch", "python3-torch")
        with self.c.fetch("k", output="tensor") as t:
            u = torch.from_dlpack(t)  # torch 1.13: legacy; newer torch: DLPack 1.0
        gc.collect()
        self.assertTrue(torch.equal(u, torch.from_numpy(self.want)))

    def test_lease_is_read_only(self):
        with self.c.fetch("k", lease=True, output="tensor") as t:
            self.assertGreaterEqual(self.c.stats()["leases"], 1)
            self.assertTrue(t.readonly)
            self.assertIn("readonly", repr(t))
            cap = t.__dlpack__(max_version=(1, 0))
            m = consume_versioned(cap)
            self.assertEqual(m.flags & _lib.FLAG_READ_ONLY, _lib.FLAG_READ_ONLY)
            delete_versioned(m)
            a = t.numpy()
            self.assertFalse(a.flags.writeable)
            with self.assertRaises(ValueError):
                a[0, 0] = 1
            self.assertTrue(t.memoryview().readonly)
            self.assertTrue((a == self.want).all())
            del a
        # Not a lease: writable.
        with self.c.fetch("k", output="tensor") as t:
            self.assertTrue(t.numpy().flags.writeable)
            self.assertFalse(t.memoryview().readonly)

    def test_copy(self):
        with self.c.fetch("k", lease=True, output="tensor") as t:
            m = consume_versioned(t.__dlpack__(max_version=(1, 0), copy=True))
            self.assertEqual(m.flags, _lib.FLAG_IS_COPIED)  # a writable copy
            self.assertNotEqual(m.dl_tensor.data, t.data_ptr)
            self.assertEqual(ctypes.string_at(m.dl_tensor.data, t.nbytes), self.want.tobytes())
            delete_versioned(m)
            with self.assertRaises(BufferError):
                t.__dlpack__(copy=True)  # a legacy capsule cannot say it is a copy
            with self.assertRaises(BufferError):
                t.__dlpack__(max_version=(1, 0), dl_device=(2, 0))  # CUDA
            self.assertEqual(capsule_name(t.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=False)),
                             b"dltensor_versioned")

    # --- import ----------------------------------------------------------

    def roundtrip(self, producer, want):
        self.c.send("in", producer)
        with self.srv.take("in", output="tensor") as got:
            self.assertEqual(got.dtype, "float32")
            self.assertEqual(got.tobytes(), want)

    def test_import_hand_made_producers(self):
        data = bytearray(np.arange(50, dtype=np.float32).tobytes())
        for versioned in (True, False):
            with self.subTest(versioned=versioned):
                p = HandMadeProducer(data, versioned)
                self.roundtrip(p, bytes(data))
                gc.collect()
                self.assertEqual(p.deleted, 1, "the consumed tensor was not deleted once")

    def test_import_versioned_library_tensor(self):
        # A DLPack 1.0 capsule of another producer (here: the library's own
        # DLManagedTensorVersioned, through a wrapper) is consumed and
        # deleted after the send.
        with self.c.fetch("k", output="tensor") as t:
            self.roundtrip(Forward(t), self.want.tobytes())
            gc.collect()
            self.assertEqual(tensorrpc.live_tensors(), self.live + 1)  # only t

    def test_import_legacy_producers(self):
        # NumPy 1.24 arrays and torch 1.13 tensors know only the legacy
        # protocol (TypeError for max_version), behind a wrapper so that
        # describe() goes through __dlpack__.
        a = np.arange(50, dtype=np.float32)
        self.roundtrip(Forward(a), a.tobytes())
        torch = _need.module(self, "torch", "python3-torch")
        self.roundtrip(Forward(torch.from_numpy(a)), a.tobytes())

    def test_import_refuses(self):
        data = bytearray(64)
        p = HandMadeProducer(data, True, major=2)
        with self.assertRaises(tensorrpc.InvalidArgumentError) as cm:
            self.c.send("bad", p)
        self.assertIn("DLPack version 2", str(cm.exception))
        gc.collect()
        self.assertEqual(p.deleted, 1, "the unconsumed capsule's destructor did not delete it")
        p = HandMadeProducer(data, True, strides=(1, 2))  # not C-contiguous
        with self.assertRaises(tensorrpc.InvalidArgumentError) as cm:
            self.c.send("bad", p)
        self.assertIn("contiguous", str(cm.exception))
        gc.collect()
        self.assertEqual(p.deleted, 1)


if __name__ == "__main__":
    unittest.main()
