package mempool

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"
	"unsafe"
)

// Ring is a single-producer, single-consumer byte ring for variable-size
// records with explicit credits, laid out entirely inside the memory it is
// given: a second process that maps the same memfd can AttachRing and act
// as the other end. The producer reserves space, fills it and commits it;
// the consumer reads committed records and releases their space, which is
// the producer's credit.
//
// Layout: a 192-byte header (magic, capacity, then the producer's tail and
// the consumer's head on separate cache lines, each a uint64 byte counter
// that only grows) and the data area. Each record is an 8-byte header
// (length, kind) and its payload, padded to 8 bytes. A record that does not
// fit before the end of the data area is preceded by a padding record that
// fills the end, and starts again at the beginning.
//
// One Ring value is one end: use a value only from the producer side or only
// from the consumer side, and from one goroutine at a time.
type Ring struct {
	mem  []byte
	data []byte
	cap  uint64
	tail *uint64 // producer's commit counter, in mem
	head *uint64 // consumer's release counter, in mem

	// Producer state: the reservation not yet committed.
	resv    bool
	resvPad uint64 // padding bytes before the reserved record
	resvLen int

	// Consumer state: the counter just past the last record read.
	read uint64
	err  error
}

const (
	ringMagic     = 0x3167_6e69_5243_5054 // "TPCRing1", little-endian
	ringHeader    = 192
	ringMagicOff  = 0
	ringCapOff    = 8
	ringTailOff   = 64
	ringHeadOff   = 128
	recordHeader  = 8
	kindRecord    = 1
	kindPadding   = 2
	minRingLength = ringHeader + 64
)

// NewRing formats mem as an empty ring and returns its producer-or-consumer
// end. mem must be 8-byte aligned (any arena or buffer is) and at least 256
// bytes; the data area is the rest after the 192-byte header, rounded down
// to a multiple of 8. mem must stay valid while either end uses it.
func NewRing(mem []byte) (*Ring, error) {
	if err := checkRingMemory(mem); err != nil {
		return nil, err
	}
	r := ringOver(mem, uint64(len(mem)-ringHeader)&^7)
	atomic.StoreUint64(r.tail, 0)
	atomic.StoreUint64(r.head, 0)
	atomic.StoreUint64(r.word(ringCapOff), r.cap)
	atomic.StoreUint64(r.word(ringMagicOff), ringMagic)
	return r, nil
}

// AttachRing returns another end of a ring that NewRing formatted in the
// same memory, possibly in another process. It trusts nothing it finds
// there: a header that does not fit mem is an error, and the consumer
// checks every record before returning it.
func AttachRing(mem []byte) (*Ring, error) {
	if err := checkRingMemory(mem); err != nil {
		return nil, err
	}
	r := ringOver(mem, 0)
	if m := atomic.LoadUint64(r.word(ringMagicOff)); m != ringMagic {
		return nil, fmt.Errorf("%w: bad magic %#x", ErrRingCorrupt, m)
	}
	c := atomic.LoadUint64(r.word(ringCapOff))
	if c < 64 || c%8 != 0 || c > uint64(len(mem)-ringHeader) {
		return nil, fmt.Errorf("%w: capacity %d in %d bytes of memory", ErrRingCorrupt, c, len(mem))
	}
	r.cap, r.data = c, mem[ringHeader:ringHeader+int(c)]
	r.read = atomic.LoadUint64(r.head)
	if used := atomic.LoadUint64(r.tail) - r.read; used > c {
		return nil, fmt.Errorf("%w: %d bytes used of %d", ErrRingCorrupt, used, c)
	}
	return r, nil
}

func checkRingMemory(mem []byte) error {
	if len(mem) < minRingLength {
		return fmt.Errorf("mempool: ring memory of %d bytes, need at least %d", len(mem), minRingLength)
	}
	if uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%8 != 0 {
		return fmt.Errorf("mempool: ring memory is not 8-byte aligned")
	}
	return nil
}

func ringOver(mem []byte, capacity uint64) *Ring {
	r := &Ring{mem: mem, cap: capacity, data: mem[ringHeader : ringHeader+int(capacity)]}
	r.tail, r.head = r.word(ringTailOff), r.word(ringHeadOff)
	r.read = 0
	return r
}

// word points at the uint64 at off in the header. checkRingMemory has made
// sure mem is 8-byte aligned and long enough, and mem outlives the Ring.
func (r *Ring) word(off int) *uint64 { return (*uint64)(unsafe.Pointer(&r.mem[off])) }

// Cap is the size of the data area in bytes.
func (r *Ring) Cap() int { return int(r.cap) }

// MaxRecord is the largest payload Reserve accepts: half the data area less
// a record header (so that a record always fits once the ring drains,
// wherever the counters stand), and at most 2 GiB.
func (r *Ring) MaxRecord() int { return int(min(r.cap/2-recordHeader, 1<<31)) }

// Used is the bytes committed and not yet released by the consumer,
// headers and padding included.
func (r *Ring) Used() int { return int(atomic.LoadUint64(r.tail) - atomic.LoadUint64(r.head)) }

// Free is the producer's credit: the bytes it may still commit.
func (r *Ring) Free() int { return int(r.cap) - r.Used() }

// Reserve returns n bytes of the ring for the producer to fill before
// Commit. It never blocks: without enough credit it returns ErrRingFull.
// A record larger than MaxRecord is refused with ErrTooLarge. Reserving
// again before Commit replaces the reservation.
func (r *Ring) Reserve(n int) ([]byte, error) {
	if n < 0 || n > r.MaxRecord() {
		return nil, fmt.Errorf("%w: ring record of %d bytes (at most %d)", ErrTooLarge, n, r.MaxRecord())
	}
	tail := atomic.LoadUint64(r.tail)
	pos := tail % r.cap
	total := recordSize(n)
	var pad uint64
	if pos+total > r.cap {
		pad = r.cap - pos
	}
	if tail+pad+total-atomic.LoadUint64(r.head) > r.cap {
		r.resv = false
		return nil, ErrRingFull
	}
	r.resv, r.resvPad, r.resvLen = true, pad, n
	at := (pos + pad) % r.cap
	return r.data[at+recordHeader : at+recordHeader+uint64(n) : at+recordHeader+uint64(n)], nil
}

// Commit publishes the first n bytes of the reserved space as a record
// (n may be less than reserved) and gives it to the consumer.
func (r *Ring) Commit(n int) error {
	if !r.resv {
		return fmt.Errorf("mempool: ring commit without a reservation")
	}
	if n < 0 || n > r.resvLen {
		return fmt.Errorf("mempool: ring commit of %d bytes, %d reserved", n, r.resvLen)
	}
	tail := atomic.LoadUint64(r.tail)
	pos := tail % r.cap
	if r.resvPad > 0 {
		putRecordHeader(r.data[pos:], uint32(r.resvPad), kindPadding)
		pos = 0
	}
	putRecordHeader(r.data[pos:], uint32(n), kindRecord)
	r.resv = false
	// The store publishes the headers and the payload written before it.
	atomic.StoreUint64(r.tail, tail+r.resvPad+recordSize(n))
	return nil
}

// Read returns the next committed record, or false when there is none (or
// the ring is corrupt: see Err). The record stays valid until Release. In
// memory shared with another process the producer can still write to it:
// copy what must not change under you.
func (r *Ring) Read() ([]byte, bool) { return r.next(false) }

// Peek returns the record Read would return next, without taking it: the
// next Read or Peek returns it again.
func (r *Ring) Peek() ([]byte, bool) { return r.next(true) }

func (r *Ring) next(peek bool) ([]byte, bool) {
	if r.err != nil {
		return nil, false
	}
	tail := atomic.LoadUint64(r.tail)
	if tail-atomic.LoadUint64(r.head) > r.cap || tail-r.read > r.cap {
		r.err = fmt.Errorf("%w: tail %d is more than a ring ahead of head", ErrRingCorrupt, tail)
		return nil, false
	}
	for r.read != tail {
		pos := r.read % r.cap
		if pos%8 != 0 { // records are 8-aligned; a peer wrote a bad head
			r.err = fmt.Errorf("%w: read position %d is not 8-byte aligned", ErrRingCorrupt, r.read)
			return nil, false
		}
		length, kind := recordHeaderAt(r.data[pos:])
		switch kind {
		case kindPadding:
			if uint64(length) != r.cap-pos || r.read+uint64(length) > tail {
				r.err = fmt.Errorf("%w: padding of %d bytes at %d", ErrRingCorrupt, length, pos)
				return nil, false
			}
			r.read += uint64(length)
		case kindRecord:
			total := recordSize(int(length))
			if pos+total > r.cap || r.read+total > tail {
				r.err = fmt.Errorf("%w: record of %d bytes at %d", ErrRingCorrupt, length, pos)
				return nil, false
			}
			if !peek {
				r.read += total
			}
			start := pos + recordHeader
			return r.data[start : start+uint64(length) : start+uint64(length)], true
		default:
			r.err = fmt.Errorf("%w: record kind %d at %d", ErrRingCorrupt, kind, pos)
			return nil, false
		}
	}
	return nil, false
}

// Release gives the space of every record Read has returned back to the
// producer. Those records must not be used afterwards.
func (r *Ring) Release() { atomic.StoreUint64(r.head, r.read) }

// Err is the reason Read stopped returning records, nil unless the ring was
// found corrupt.
func (r *Ring) Err() error { return r.err }

func recordSize(n int) uint64 { return recordHeader + (uint64(n)+7)&^7 }

func putRecordHeader(b []byte, length, kind uint32) {
	binary.LittleEndian.PutUint64(b, uint64(length)|uint64(kind)<<32)
}

func recordHeaderAt(b []byte) (length, kind uint32) {
	h := binary.LittleEndian.Uint64(b)
	return uint32(h), uint32(h >> 32)
}
