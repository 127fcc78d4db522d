package verbstest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// waitTimeout bounds every wait in the suite, so that a broken provider
// fails the test instead of hanging it.
const waitTimeout = 20 * time.Second

// Connect connects two queue pairs to each other: it exchanges their
// LocalInfo and runs both Connect calls concurrently, as two hosts would.
// It returns the errors of both sides, joined.
func Connect(ctx context.Context, a, b verbs.QueuePair) error {
	infoA, infoB := a.LocalInfo(), b.LocalInfo()
	done := make(chan error, 1)
	go func() { done <- b.Connect(ctx, infoA) }()
	errA := a.Connect(ctx, infoB)
	errB := <-done
	var errs []error
	if errA != nil {
		errs = append(errs, fmt.Errorf("connect a: %w", errA))
	}
	if errB != nil {
		errs = append(errs, fmt.Errorf("connect b: %w", errB))
	}
	return errors.Join(errs...)
}

// side is one end of a test: a domain, its completion queues and a queue
// pair.
type side struct {
	name     string
	pd       verbs.ProtectionDomain
	scq, rcq verbs.CompletionQueue
	qp       verbs.QueuePair
}

// pair is two connected ends, a and b.
type pair struct {
	t     *testing.T
	env   Env
	a, b  *side
	extra []*side // more queue pairs on a's and b's domains (addPair)
}

// suiteMaxDepth is the deepest send or receive queue the suite asks for,
// and the default depth (MaxSend or MaxRecv zero means 1024). Attributes
// must allow it.
const suiteMaxDepth = 1024

// options configures newPair.
type options struct {
	cqCapacity int                   // each CQ's capacity; default 4096
	qp         verbs.QueuePairConfig // CQs are filled in by newPair
	sharedCQ   bool                  // one CQ per side for sends and receives
	noConnect  bool                  // leave the queue pairs in RESET
}

// newPair opens two domains and makes connected queue pairs on them. On
// failure it releases what it made and fails the test.
func newPair(t *testing.T, env Env, o options) *pair {
	t.Helper()
	if o.cqCapacity == 0 {
		o.cqCapacity = 4096
	}
	p := &pair{t: t, env: env}
	ok := false
	defer func() {
		if !ok {
			p.close()
		}
	}()
	pdA, pdB := env.Open(t)
	if pdA == nil || pdB == nil {
		t.Fatalf("%s: Env.Open returned a nil domain", env.Name)
	}
	p.a = &side{name: "a", pd: pdA}
	p.b = &side{name: "b", pd: pdB}
	for _, s := range []*side{p.a, p.b} {
		var err error
		if s.scq, err = s.pd.NewCompletionQueue(o.cqCapacity); err != nil {
			t.Fatalf("%s: side %s: NewCompletionQueue(%d): %v", env.Name, s.name, o.cqCapacity, err)
		}
		s.rcq = s.scq
		if !o.sharedCQ {
			if s.rcq, err = s.pd.NewCompletionQueue(o.cqCapacity); err != nil {
				t.Fatalf("%s: side %s: NewCompletionQueue(%d): %v", env.Name, s.name, o.cqCapacity, err)
			}
		}
		cfg := o.qp
		cfg.SendCQ, cfg.RecvCQ = s.scq, s.rcq
		if s.qp, err = s.pd.NewQueuePair(cfg); err != nil {
			t.Fatalf("%s: side %s: NewQueuePair: %v", env.Name, s.name, err)
		}
	}
	if !o.noConnect {
		p.connect()
	}
	ok = true
	return p
}

// connect connects a's and b's queue pairs and proves the connection with
// RoundTrip, as the contract asks of every user of Connect.
func (p *pair) connect() {
	p.t.Helper()
	p.connectOnly()
	p.verify(p.a, p.b)
}

// connectOnly connects a's and b's queue pairs without the round trip, for
// cases that have receives posted before Connect (the round trip's Send
// would land in them).
func (p *pair) connectOnly() {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := Connect(ctx, p.a.qp, p.b.qp); err != nil {
		p.t.Fatalf("%s: %v", p.env.Name, err)
	}
}

// verify runs RoundTrip between two connected sides; it leaves no
// completion behind and gives back all the queue room it used.
func (p *pair) verify(a, b *side) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	err := RoundTrip(ctx,
		End{QP: a.qp, SendCQ: a.scq, RecvCQ: a.rcq, Buf: p.region(a, RoundTripBytes, verbs.AccessLocalWrite)},
		End{QP: b.qp, SendCQ: b.scq, RecvCQ: b.rcq, Buf: p.region(b, RoundTripBytes, verbs.AccessLocalWrite)})
	if err != nil {
		p.t.Fatalf("%s: sides %s and %s connected, but the round trip over the connection failed: %v", p.env.Name, a.name, b.name, err)
	}
}

// End is one side of a connection, for RoundTrip.
type End struct {
	QP             verbs.QueuePair
	SendCQ, RecvCQ verbs.CompletionQueue // the queue pair's completion queues
	// Buf is a region of the queue pair's domain with AccessLocalWrite and
	// at least RoundTripBytes bytes; RoundTrip overwrites its first
	// RoundTripBytes bytes.
	Buf verbs.MemoryRegion
}

// RoundTripBytes is the size of the buffer RoundTrip needs on each side.
const RoundTripBytes = 16

// Work request IDs RoundTrip uses for its Send and Recv on both sides.
const (
	RoundTripSendID uint64 = math.MaxUint64 - 1
	RoundTripRecvID uint64 = math.MaxUint64 - 2
)

// RoundTrip proves that two queue pairs that Connect reported connected
// can really reach each other: a sends a random 8-byte nonce, b receives it
// and answers with a Send of its complement, and a receives the answer.
// Connect does not prove reachability (on ibv it only changes queue pair
// state), so a user of the contract verifies a new connection this way
// before relying on it; the suite does it after every Connect.
//
// Neither queue pair may have receives posted or completions pending when
// RoundTrip starts (they would take its Send or its completions). On
// success it has consumed exactly its own completions: 1 Send and 1 Recv
// on each side, with IDs RoundTripSendID and RoundTripRecvID. It returns
// the first error: a refused post, a failed or unexpected completion, a
// wrong payload, or ctx's end.
func RoundTrip(ctx context.Context, a, b End) error {
	for _, e := range []End{a, b} {
		if e.QP == nil || e.SendCQ == nil || e.RecvCQ == nil || e.Buf == nil {
			return errors.New("verbstest: RoundTrip: End needs QP, SendCQ, RecvCQ and Buf")
		}
		if e.Buf.Len() < RoundTripBytes {
			return fmt.Errorf("verbstest: RoundTrip: Buf has %d bytes, want at least %d", e.Buf.Len(), RoundTripBytes)
		}
	}
	nonce := rand.Uint64() | 1
	answer := ^nonce
	le := binary.LittleEndian
	clear(a.Buf.Bytes()[:RoundTripBytes])
	clear(b.Buf.Bytes()[:RoundTripBytes])
	le.PutUint64(a.Buf.Bytes(), nonce)
	if err := b.QP.PostRecv(recv(RoundTripRecvID, b.Buf, 8, 8)); err != nil {
		return fmt.Errorf("round trip: PostRecv at b: %w", err)
	}
	if err := a.QP.PostRecv(recv(RoundTripRecvID, a.Buf, 8, 8)); err != nil {
		return fmt.Errorf("round trip: PostRecv at a: %w", err)
	}
	if err := a.QP.PostSend(send(RoundTripSendID, a.Buf, 0, 8)); err != nil {
		return fmt.Errorf("round trip: PostSend at a: %w", err)
	}
	if err := awaitIDs(ctx, b, false, true); err != nil {
		return fmt.Errorf("round trip: b receiving the nonce: %w", err)
	}
	if got := le.Uint64(b.Buf.Bytes()[8:]); got != nonce {
		return fmt.Errorf("round trip: b received %#x, want the nonce %#x", got, nonce)
	}
	le.PutUint64(b.Buf.Bytes(), answer)
	if err := b.QP.PostSend(send(RoundTripSendID, b.Buf, 0, 8)); err != nil {
		return fmt.Errorf("round trip: PostSend at b: %w", err)
	}
	if err := awaitIDs(ctx, a, true, true); err != nil {
		return fmt.Errorf("round trip: a sending the nonce and receiving the answer: %w", err)
	}
	if err := awaitIDs(ctx, b, true, false); err != nil {
		return fmt.Errorf("round trip: b sending the answer: %w", err)
	}
	if got := le.Uint64(a.Buf.Bytes()[8:]); got != answer {
		return fmt.Errorf("round trip: a received %#x, want the answer %#x", got, answer)
	}
	return nil
}

// awaitIDs waits for the round trip's successful Send completion on
// e.SendCQ (when sendC) and Recv completion on e.RecvCQ (when recvC), and
// fails on any other completion.
func awaitIDs(ctx context.Context, e End, sendC, recvC bool) error {
	type want struct {
		cq verbs.CompletionQueue
		id uint64
		op verbs.Opcode
	}
	var wants []want
	if sendC {
		wants = append(wants, want{e.SendCQ, RoundTripSendID, verbs.OpSend})
	}
	if recvC {
		wants = append(wants, want{e.RecvCQ, RoundTripRecvID, verbs.OpRecv})
	}
	for len(wants) > 0 {
		cq := wants[0].cq
		var buf [1]verbs.Completion
		n, err := cq.Wait(ctx, buf[:])
		if err != nil {
			return err
		}
		if n == 0 {
			continue
		}
		c := buf[0]
		found := -1
		for i, w := range wants {
			if w.cq == cq && w.id == c.ID && w.op == c.Op {
				found = i
			}
		}
		if found < 0 || c.Status != verbs.StatusSuccess || c.Len != 8 {
			return fmt.Errorf("unexpected completion %s", describe([]verbs.Completion{c}))
		}
		wants = append(wants[:found], wants[found+1:]...)
	}
	return nil
}

// close closes both ends: queue pairs, then completion queues, then domains.
// Close is idempotent, so closing something a case already closed (or that
// its domain closed) must return nil.
func (p *pair) close() {
	p.t.Helper()
	for _, s := range append(p.extra, p.a, p.b) {
		if s == nil {
			continue
		}
		if s.qp != nil {
			p.checkClose("queue pair", s.name, s.qp.Close())
		}
		if s.scq != nil {
			p.checkClose("send completion queue", s.name, s.scq.Close())
		}
		if s.rcq != nil && s.rcq != s.scq {
			p.checkClose("receive completion queue", s.name, s.rcq.Close())
		}
		if s.pd != nil && (s == p.a || s == p.b) {
			p.checkClose("protection domain", s.name, s.pd.Close())
		}
	}
}

func (p *pair) checkClose(what, name string, err error) {
	p.t.Helper()
	if err != nil {
		p.t.Errorf("%s: side %s: closing the %s: %v (Close is idempotent: want nil)", p.env.Name, name, what, err)
	}
}

// addPair makes a second connected (and verified) pair of queue pairs on
// the domains of a and b, each with its own completion queue for sends and
// receives. p.close closes them.
func (p *pair) addPair(cfg verbs.QueuePairConfig) (a2, b2 *side) {
	p.t.Helper()
	var made []*side
	for _, s := range []*side{p.a, p.b} {
		cq, err := s.pd.NewCompletionQueue(4096)
		if err != nil {
			p.t.Fatalf("%s: side %s: NewCompletionQueue: %v", p.env.Name, s.name, err)
		}
		n := &side{name: s.name + "2", pd: s.pd, scq: cq, rcq: cq}
		p.extra = append(p.extra, n)
		c := cfg
		c.SendCQ, c.RecvCQ = cq, cq
		if n.qp, err = s.pd.NewQueuePair(c); err != nil {
			p.t.Fatalf("%s: side %s: NewQueuePair: %v", p.env.Name, n.name, err)
		}
		made = append(made, n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := Connect(ctx, made[0].qp, made[1].qp); err != nil {
		p.t.Fatalf("%s: second pair: %v", p.env.Name, err)
	}
	p.verify(made[0], made[1])
	return made[0], made[1]
}

// attrs returns s's domain's Attributes.
func (p *pair) attrs(s *side) verbs.Attributes { return s.pd.Attributes() }

// expectErr fails the test unless err wraps want.
func (p *pair) expectErr(err, want error, what string) {
	p.t.Helper()
	if !errors.Is(err, want) {
		p.t.Fatalf("%s: %s: got %v, want an error wrapping %v", p.env.Name, what, err, want)
	}
}

// expectQPErr is expectErr for an error of a queue pair's verb, which on
// every provider names the provider and the queue pair ("tcp: queue pair
// 7: ...") and, when the queue pair is in ERR, says why after ErrQPError.
func (p *pair) expectQPErr(err, want error, what string) {
	p.t.Helper()
	p.expectErr(err, want, what)
	msg := err.Error()
	if !strings.Contains(msg, "queue pair ") {
		p.t.Fatalf("%s: %s: %q does not name the queue pair", p.env.Name, what, msg)
	}
	if want == verbs.ErrQPError {
		if i := strings.Index(msg, verbs.ErrQPError.Error()); i < 0 || len(msg) <= i+len(verbs.ErrQPError.Error())+2 {
			p.t.Fatalf("%s: %s: %q does not give the cause of ERR", p.env.Name, what, msg)
		}
	}
}

// seg is a local segment.
func seg(mr verbs.MemoryRegion, off, n int) verbs.Local {
	return verbs.Local{Region: mr, Offset: off, Length: n}
}

// gather returns the bytes segs name, concatenated.
func gather(segs []verbs.Local) []byte {
	var b []byte
	for _, s := range segs {
		b = append(b, s.Region.Bytes()[s.Offset:s.Offset+s.Length]...)
	}
	return b
}

// segLen is the total length of segs.
func segLen(segs []verbs.Local) int {
	n := 0
	for _, s := range segs {
		n += s.Length
	}
	return n
}

// region registers size bytes of fresh memory on s.
func (p *pair) region(s *side, size int, access verbs.Access) verbs.MemoryRegion {
	p.t.Helper()
	mem := p.env.NewMemory(p.t, size)
	mr, err := s.pd.RegisterMemory(mem, access)
	if err != nil {
		p.t.Fatalf("%s: side %s: RegisterMemory(%d bytes, %v): %v", p.env.Name, s.name, size, access, err)
	}
	if mr.Len() != size || len(mr.Bytes()) != size {
		p.t.Fatalf("%s: side %s: region has Len %d and %d Bytes, want %d", p.env.Name, s.name, mr.Len(), len(mr.Bytes()), size)
	}
	if mr.Access() != access {
		p.t.Errorf("%s: side %s: region Access is %v, want %v", p.env.Name, s.name, mr.Access(), access)
	}
	return mr
}

// guarded is a registered region in the middle of a larger buffer, with
// guard pages on both sides that the region's users must never touch.
type guarded struct {
	mr       verbs.MemoryRegion
	all      []byte // guard, region, guard
	snapshot []byte // all, as it was filled
}

// guardedRegion registers size bytes that start one page into a buffer and
// end at least one page before its end, and fills the whole buffer with a
// pattern.
func (p *pair) guardedRegion(s *side, size int, access verbs.Access) *guarded {
	p.t.Helper()
	page := os.Getpagesize()
	total := page + (size+page-1)/page*page + page
	mem := p.env.NewMemory(p.t, total)
	fill(mem.Bytes, 0xfeed)
	mr, err := s.pd.RegisterMemory(subMemory(mem, page, size), access)
	if err != nil {
		p.t.Fatalf("%s: side %s: RegisterMemory(%d bytes in the middle of %d, %v): %v", p.env.Name, s.name, size, total, access, err)
	}
	return &guarded{mr: mr, all: mem.Bytes, snapshot: append([]byte(nil), mem.Bytes...)}
}

// checkUntouched fails the test when any byte of the buffer, guards or
// region, changed since it was filled.
func (g *guarded) checkUntouched(t *testing.T, what string) {
	t.Helper()
	page := os.Getpagesize()
	for i := range g.all {
		if g.all[i] != g.snapshot[i] {
			where := "the region"
			if i < page {
				where = "the guard before the region"
			} else if i >= page+g.mr.Len() {
				where = "the guard after the region"
			}
			t.Fatalf("%s: byte %d of the buffer (%s) changed from %#x to %#x", what, i, where, g.snapshot[i], g.all[i])
		}
	}
}

// refill fills the whole buffer with another pattern and takes a new
// snapshot.
func (g *guarded) refill(seed uint64) {
	fill(g.all, seed)
	g.snapshot = append(g.snapshot[:0], g.all...)
}

// checkOnly fails the test unless the region's bytes at [off, off+len(want))
// equal want and every other byte of the buffer, guards included, is as it
// was filled.
func (g *guarded) checkOnly(t *testing.T, what string, off int, want []byte) {
	t.Helper()
	page := os.Getpagesize()
	exp := append([]byte(nil), g.snapshot...)
	copy(exp[page+off:], want)
	for i := range g.all {
		if g.all[i] != exp[i] {
			where := fmt.Sprintf("byte %d of the region", i-page)
			if i < page {
				where = "the guard before the region"
			} else if i >= page+g.mr.Len() {
				where = "the guard after the region"
			} else if i < page+off || i >= page+off+len(want) {
				where += fmt.Sprintf(", outside the %d written bytes at %d", len(want), off)
			}
			t.Fatalf("%s: byte %d of the buffer (%s) is %#x, want %#x", what, i, where, g.all[i], exp[i])
		}
	}
}

// subMemory is n bytes of m starting at off.
func subMemory(m verbs.Memory, off, n int) verbs.Memory {
	return verbs.Memory{
		Bytes:    m.Bytes[off : off+n : off+n],
		HasFD:    m.HasFD,
		FD:       m.FD,
		FDOffset: m.FDOffset + int64(off),
	}
}

// fill fills b with a pseudo-random pattern chosen by seed.
func fill(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	i := 0
	for ; i+8 <= len(b); i += 8 {
		v := r.Uint64()
		b[i], b[i+1], b[i+2], b[i+3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
		b[i+4], b[i+5], b[i+6], b[i+7] = byte(v>>32), byte(v>>40), byte(v>>48), byte(v>>56)
	}
	for ; i < len(b); i++ {
		b[i] = byte(r.Uint32())
	}
}

// checkBytes fails the test when got differs from want, naming the first
// differing byte.
func checkBytes(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d bytes, want %d", what, len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("%s: byte %d of %d is %#x, want %#x", what, i, len(got), got[i], want[i])
		}
	}
}

// collect waits for exactly n completions on cq.
func collect(ctx context.Context, cq verbs.CompletionQueue, n int) ([]verbs.Completion, error) {
	out := make([]verbs.Completion, 0, n)
	buf := make([]verbs.Completion, 64)
	for len(out) < n {
		k, err := cq.Wait(ctx, buf[:min(len(buf), n-len(out))])
		if err != nil {
			return out, fmt.Errorf("waiting for %d completions, got %d: %w", n, len(out), err)
		}
		if k <= 0 && ctx.Err() == nil {
			continue
		}
		out = append(out, buf[:k]...)
	}
	return out, nil
}

// wait waits for exactly n completions on cq, failing the test after
// waitTimeout.
func (p *pair) wait(cq verbs.CompletionQueue, n int, what string) []verbs.Completion {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	cs, err := collect(ctx, cq, n)
	if err != nil {
		p.t.Fatalf("%s: %s: %v (got %v)", p.env.Name, what, err, describe(cs))
	}
	return cs
}

// expectQuiet fails the test when cq yields a completion within d.
func (p *pair) expectQuiet(cq verbs.CompletionQueue, d time.Duration, what string) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	buf := make([]verbs.Completion, 8)
	n, err := cq.Wait(ctx, buf)
	if n > 0 {
		p.t.Fatalf("%s: %s: unexpected completions %v", p.env.Name, what, describe(buf[:n]))
	}
	if err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, verbs.ErrClosed) {
		p.t.Fatalf("%s: %s: Wait: %v", p.env.Name, what, err)
	}
}

// expectOK fails the test unless every completion succeeded with opcode op.
func (p *pair) expectOK(cs []verbs.Completion, op verbs.Opcode, what string) {
	p.t.Helper()
	for _, c := range cs {
		if c.Status != verbs.StatusSuccess {
			p.t.Fatalf("%s: %s: %v", p.env.Name, what, verbs.CompletionError(c))
		}
		if c.Op != op {
			p.t.Fatalf("%s: %s: completion %d has opcode %v, want %v", p.env.Name, what, c.ID, c.Op, op)
		}
		if c.Err != nil {
			p.t.Fatalf("%s: %s: successful completion %d carries an error: %v", p.env.Name, what, c.ID, c.Err)
		}
	}
}

// byID indexes completions by ID and fails the test on a duplicate.
func (p *pair) byID(cs []verbs.Completion, what string) map[uint64]verbs.Completion {
	p.t.Helper()
	m := make(map[uint64]verbs.Completion, len(cs))
	for _, c := range cs {
		if prev, dup := m[c.ID]; dup {
			p.t.Fatalf("%s: %s: two completions for work request %d: %v and %v", p.env.Name, what, c.ID, describe([]verbs.Completion{prev}), describe([]verbs.Completion{c}))
		}
		m[c.ID] = c
	}
	return m
}

// describe formats completions for failure messages.
func describe(cs []verbs.Completion) string {
	s := "["
	for i, c := range cs {
		if i > 0 {
			s += ", "
		}
		if i == 8 && len(cs) > 9 {
			s += fmt.Sprintf("... %d more", len(cs)-8)
			break
		}
		s += fmt.Sprintf("{id %d %v %v len %d", c.ID, c.Op, c.Status, c.Len)
		if c.HasImm {
			s += fmt.Sprintf(" imm %#x", c.Imm)
		}
		if c.Err != nil {
			s += fmt.Sprintf(" err %q", c.Err)
		}
		s += "}"
	}
	return s + "]"
}

// write is a Write work request of n bytes from local offset off to the
// peer region mr at offset roff.
func write(id uint64, local verbs.MemoryRegion, off, n int, remote verbs.MemoryRegion, roff int) verbs.SendRequest {
	return verbs.SendRequest{
		ID:     id,
		Op:     verbs.OpWrite,
		Local:  verbs.Local{Region: local, Offset: off, Length: n},
		Remote: verbs.Remote{Addr: remote.Addr() + uint64(roff), Key: remote.RemoteKey()},
	}
}

// read is a Read work request of n bytes from the peer region mr at offset
// roff into local offset off.
func read(id uint64, local verbs.MemoryRegion, off, n int, remote verbs.MemoryRegion, roff int) verbs.SendRequest {
	wr := write(id, local, off, n, remote, roff)
	wr.Op = verbs.OpRead
	return wr
}

// send is a Send work request of n bytes at local offset off.
func send(id uint64, local verbs.MemoryRegion, off, n int) verbs.SendRequest {
	return verbs.SendRequest{ID: id, Op: verbs.OpSend, Local: verbs.Local{Region: local, Offset: off, Length: n}}
}

// recv is a Recv work request for n bytes at local offset off.
func recv(id uint64, local verbs.MemoryRegion, off, n int) verbs.RecvRequest {
	return verbs.RecvRequest{ID: id, Local: verbs.Local{Region: local, Offset: off, Length: n}}
}

// postSend posts wrs on s and fails the test on error.
func (p *pair) postSend(s *side, wrs ...verbs.SendRequest) {
	p.t.Helper()
	if err := s.qp.PostSend(wrs...); err != nil {
		p.t.Fatalf("%s: side %s: PostSend of %d requests: %v", p.env.Name, s.name, len(wrs), err)
	}
}

// postRecv posts wrs on s and fails the test on error.
func (p *pair) postRecv(s *side, wrs ...verbs.RecvRequest) {
	p.t.Helper()
	if err := s.qp.PostRecv(wrs...); err != nil {
		p.t.Fatalf("%s: side %s: PostRecv of %d requests: %v", p.env.Name, s.name, len(wrs), err)
	}
}

// waitState waits until s's queue pair reaches want.
func (p *pair) waitState(s *side, want verbs.QPState) {
	p.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for s.qp.State() != want {
		if time.Now().After(deadline) {
			p.t.Fatalf("%s: side %s: queue pair state is %v after %v, want %v", p.env.Name, s.name, s.qp.State(), waitTimeout, want)
		}
		time.Sleep(time.Millisecond)
	}
}
