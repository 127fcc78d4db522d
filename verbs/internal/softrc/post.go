package softrc

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// Seg is one checked local segment of a work request.
type Seg struct {
	R *Region
	B []byte
}

// Vec is the checked local segments of a work request, in order.
type Vec []Seg

// Len is the total length of the segments.
func (v Vec) Len() int {
	n := 0
	for _, s := range v {
		n += len(s.B)
	}
	return n
}

// Acquire references every region of v, or none when one of them is
// deregistered (it returns that one).
func (v Vec) Acquire() (*Region, bool) {
	for i, s := range v {
		if !s.R.Acquire() {
			v[:i].Release()
			return s.R, false
		}
	}
	return nil, true
}

// Release drops the references Acquire took.
func (v Vec) Release() {
	for _, s := range v {
		s.R.Release()
	}
}

// Gather copies the bytes of v from offset off on into dst and returns how
// many it copied.
func (v Vec) Gather(dst []byte, off int) int {
	n := 0
	for _, s := range v {
		if off >= len(s.B) {
			off -= len(s.B)
			continue
		}
		k := memcopy.Copy(dst[n:], s.B[off:])
		off = 0
		n += k
		if n == len(dst) {
			break
		}
	}
	return n
}

// Scatter copies src into v from offset off on and returns how many bytes
// it copied.
func (v Vec) Scatter(off int, src []byte) int {
	n := 0
	for _, s := range v {
		if off >= len(s.B) {
			off -= len(s.B)
			continue
		}
		k := memcopy.Copy(s.B[off:], src[n:])
		off = 0
		n += k
		if n == len(src) {
			break
		}
	}
	return n
}

// ParallelMinBytes is the smallest copy GatherParallel and ScatterParallel
// split, and the least each of their goroutines copies: below it, starting
// goroutines costs more than a second core saves.
const ParallelMinBytes = 8 << 20

// GatherParallel is Gather(dst, 0) on up to workers goroutines, each
// copying a contiguous part of dst of at least ParallelMinBytes.
func (v Vec) GatherParallel(dst []byte, workers int) int {
	return parallel(len(dst), workers, func(lo, hi int) int { return v.Gather(dst[lo:hi], lo) })
}

// ScatterParallel is Scatter(0, src) on up to workers goroutines.
func (v Vec) ScatterParallel(src []byte, workers int) int {
	return parallel(len(src), workers, func(lo, hi int) int { return v.Scatter(lo, src[lo:hi]) })
}

// parallel runs f over [0, n) cut into up to workers parts of at least
// ParallelMinBytes, on as many goroutines (the caller's among them), and
// returns the sum of what f returned, once all are done.
func parallel(n, workers int, f func(lo, hi int) int) int {
	parts := min(workers, n/ParallelMinBytes)
	if parts <= 1 {
		return memcopy.Share(n, f)
	}
	step := (n/parts + 4095) &^ 4095 // page-aligned parts
	var wg sync.WaitGroup
	var done atomic.Int64
	for lo := step; lo < n; lo += step {
		wg.Add(1)
		go func(lo int) {
			defer wg.Done()
			done.Add(int64(f(lo, min(lo+step, n))))
		}(lo)
	}
	k := f(0, min(step, n))
	wg.Wait()
	return k + int(done.Load())
}

// Limits are the device attributes post-time checks use.
type Limits struct {
	MaxSegments     int
	MaxMessageBytes int64
}

// LimitsOf returns the limits in a.
func LimitsOf(a verbs.Attributes) Limits {
	return Limits{MaxSegments: a.MaxSegments, MaxMessageBytes: a.MaxMessageBytes}
}

// CheckLocal checks a request's local memory: seg when segs is empty, else
// segs, each against its region (of owner, live, with need, in bounds),
// and their number and total length against lim. It appends the segments
// to into. Bad memory wraps verbs.ErrInvalidMemory, too many segments or
// bytes verbs.ErrTooLarge.
func CheckLocal(owner any, lim Limits, seg verbs.Local, segs []verbs.Local, need verbs.Access, into Vec) (Vec, error) {
	if len(segs) == 0 {
		return checkSeg(owner, seg, need, into)
	}
	if err := CheckSegments(len(segs), lim.MaxSegments); err != nil {
		return nil, err
	}
	var err error
	for i := range segs {
		if into, err = checkSeg(owner, segs[i], need, into); err != nil {
			return nil, fmt.Errorf("segment %d: %w", i, err)
		}
	}
	if err := CheckLength(int64(into.Len()), lim.MaxMessageBytes); err != nil {
		return nil, err
	}
	return into, nil
}

func checkSeg(owner any, l verbs.Local, need verbs.Access, into Vec) (Vec, error) {
	if l.Offset < 0 || l.Length < 0 {
		return nil, fmt.Errorf("local buffer at offset %d of length %d: %w", l.Offset, l.Length, verbs.ErrInvalidMemory)
	}
	if l.Region == nil {
		if l.Length == 0 {
			return into, nil
		}
		return nil, fmt.Errorf("local buffer of %d bytes has no region: %w", l.Length, verbs.ErrInvalidMemory)
	}
	r, ok := CoreOf(l.Region, owner)
	if !ok {
		return nil, fmt.Errorf("local region does not belong to the queue pair's domain: %w", verbs.ErrInvalidMemory)
	}
	if r.access&need != need {
		return nil, fmt.Errorf("local region %#x grants %v, the request needs %v: %w", r.key, r.access, need, verbs.ErrInvalidMemory)
	}
	b, ok := r.Span(uint64(l.Offset), uint64(l.Length))
	if !ok {
		return nil, fmt.Errorf("local buffer [%d, +%d) lies outside region %#x of %d bytes: %w", l.Offset, l.Length, r.key, len(r.mem), verbs.ErrInvalidMemory)
	}
	if r.Dead() {
		return nil, fmt.Errorf("local region %#x is deregistered: %w", r.key, verbs.ErrInvalidMemory)
	}
	if len(b) == 0 {
		return into, nil
	}
	return append(into, Seg{R: r, B: b}), nil
}

// CheckSend checks a send-queue request at post time: its opcode (else
// verbs.ErrUnsupported) and its local memory (see CheckLocal; a Read's
// destination needs local write).
func CheckSend(owner any, lim Limits, wr *verbs.SendRequest, into Vec) (Vec, error) {
	need, err := CheckOpcode(wr.Op)
	if err != nil {
		return nil, err
	}
	return CheckLocal(owner, lim, wr.Local, wr.Segments, need, into)
}

// CheckRecv checks a receive at post time: its buffer needs local write.
func CheckRecv(owner any, lim Limits, wr *verbs.RecvRequest, into Vec) (Vec, error) {
	return CheckLocal(owner, lim, wr.Local, wr.Segments, verbs.AccessLocalWrite, into)
}
