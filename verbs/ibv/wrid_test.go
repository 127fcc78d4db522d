package ibv

import "testing"

func TestWRIDRoundTrip(t *testing.T) {
	for _, k := range []wrKind{wrSend, wrRecv, wrInternal} {
		for _, i := range []uint32{0, 1, 1023, 1<<31 + 5, 1<<32 - 1} {
			id := encodeWRID(k, i)
			gk, gi, ok := decodeWRID(id)
			if !ok || gk != k || gi != i {
				t.Errorf("decodeWRID(encodeWRID(%s, %d) = %#x) = %s, %d, %v", k, i, id, gk, gi, ok)
			}
		}
	}
	if encodeWRID(wrSend, 7) != 7 {
		t.Error("a send wr_id is not the bare slot index")
	}
	if encodeWRID(wrRecv, 7)&wrRecvBit == 0 || encodeWRID(wrInternal, 7)&wrInternalBit == 0 {
		t.Error("kind bits not set")
	}
}

func TestWRIDRejectsForeign(t *testing.T) {
	for _, id := range []uint64{
		wrRecvBit | wrInternalBit, // both kinds
		1 << 32,                   // bits between the index and the kind
		1<<61 | 3,
		^uint64(0),
	} {
		if k, i, ok := decodeWRID(id); ok {
			t.Errorf("decodeWRID(%#x) = %s, %d, accepted", id, k, i)
		}
	}
}

func FuzzWRID(f *testing.F) {
	f.Add(uint64(0))
	f.Add(uint64(wrRecvBit | 5))
	f.Add(uint64(wrInternalBit | 1<<31))
	f.Add(^uint64(0))
	f.Fuzz(func(t *testing.T, id uint64) {
		k, i, ok := decodeWRID(id)
		if ok && encodeWRID(k, i) != id {
			t.Fatalf("decodeWRID(%#x) = %s, %d; encodes back to %#x", id, k, i, encodeWRID(k, i))
		}
	})
}
