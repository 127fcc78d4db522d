package engine

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// Lanes are a session's queue pairs on its data plane (WithLanes). Lane 0
// is the session's link. Frames go on any lane, each with its own receive
// slots, credits and polling goroutine; what a frame call grants (and
// reads) stays on its lane, because a grant opens a buffer to one queue
// pair only (a striped transfer grants it on every lane).

// ConnectLanes connects lanes[i] to remotes[i], all at once; the first
// failure ends the others' attempts.
func ConnectLanes(ctx context.Context, lanes []*Link, remotes [][]byte) error {
	if len(lanes) != len(remotes) {
		return fmt.Errorf("%d lanes, %d remote infos", len(lanes), len(remotes))
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, len(lanes))
	var wg sync.WaitGroup
	for i, l := range lanes {
		wg.Go(func() {
			if errs[i] = l.Connect(ctx, remotes[i]); errs[i] != nil {
				cancel()
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			if len(lanes) > 1 {
				return fmt.Errorf("lane %d of %d: %w", i, len(lanes), err)
			}
			return err
		}
	}
	return nil
}

// NewLanes makes n links on dom for a session's lanes (see NewLink), or
// fewer when making one fails: it returns those it made and why it
// stopped.
func NewLanes(ctx context.Context, dom *Domain, ctl *mempool.Pool, local netip.Addr, role verbs.ConnectRole, n int) ([]*Link, error) {
	var lanes []*Link
	for len(lanes) < n {
		l, err := NewLink(ctx, dom, ctl, local, role)
		if err != nil {
			return lanes, err
		}
		lanes = append(lanes, l)
	}
	return lanes, nil
}

// CloseLanes closes every lane.
func CloseLanes(lanes []*Link, reason error) {
	for _, l := range lanes {
		l.Close(reason)
	}
}

// LaneInfos is the connection info of lanes (for TransportOffer.lanes).
func LaneInfos(lanes []*Link) [][]byte {
	var out [][]byte
	for _, l := range lanes {
		out = append(out, l.QP.LocalInfo())
	}
	return out
}

// AnyDead returns a channel closed once any of lanes has failed, and a
// function that returns the first failure; the watchers it starts end
// when every lane has (closing a lane fails it).
func AnyDead(lanes []*Link, wg *sync.WaitGroup) (<-chan struct{}, func() error) {
	dead := make(chan struct{})
	var once sync.Once
	var first *Link
	for _, l := range lanes {
		wg.Go(func() {
			<-l.Dead
			once.Do(func() {
				first = l
				close(dead)
			})
		})
	}
	return dead, func() error {
		<-dead
		first.Mu.Lock()
		defer first.Mu.Unlock()
		if first.Failure == nil {
			return errors.New("lane closed")
		}
		return first.Failure
	}
}

// OnDead runs died, in a goroutine counted in wg, with the first failure
// of lanes once any of them has failed (see AnyDead, whose watchers wg
// counts too).
func OnDead(lanes []*Link, wg *sync.WaitGroup, died func(error)) {
	dead, failure := AnyDead(lanes, wg)
	wg.Go(func() {
		<-dead
		died(failure())
	})
}

// AwaitDead waits until every lane has failed (or closed), at most
// timeout: a side whose peer ended the session keeps its lanes open for
// the answers still on their way, until the peer closes them.
func AwaitDead(lanes []*Link, timeout time.Duration) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for _, l := range lanes {
		select {
		case <-l.Dead:
		case <-t.C:
			return
		}
	}
}

// FlushLanes sends the releases still queued on every lane that carries
// frames (see Link.FlushReleases), until ctx ends.
func FlushLanes(ctx context.Context, lanes []*Link) {
	for _, l := range lanes {
		if l.Frames != nil {
			l.FlushReleases(ctx)
		}
	}
}

// LeastBusy is the lane for the next frame call: the first of those with
// the fewest requests under way (Link.Busy: calls awaiting answers, and
// one-sided Reads and Writes), nil when there is none. Calls side by side
// spread over the lanes; calls one after another stay on one, whose
// receiver is awake, instead of waking each lane's in turn (on 2 CPUs
// with 2 lanes, taking them in turn made one stream's 4 KiB Fetch slower
// than one lane: shm p50 40 against 17 µs, tcp 40 against 29). The
// one-sided requests count because a Fetch's bytes move after its answer
// came, on the lane it was answered on: counting only the calls awaiting
// answers, a stream whose Fetch was reading left its lane looking idle,
// the next stream's call took it, and its request and then its Read
// waited behind that Read (shm runs one request of a queue pair at a
// time; tcp has one connection per lane): 4 streams of 1 MiB Fetches on
// 4 lanes read [578 471 141 10] times on each lane over tcp, [351 335
// 298 216] counting the Reads.
func LeastBusy(lanes []*Link) *Link {
	var best *Link
	least := int(^uint(0) >> 1)
	for _, l := range lanes {
		n := l.Busy()
		if n < least {
			best, least = l, n
		}
		if n == 0 {
			break
		}
	}
	return best
}

// Stripes: a one-sided transfer of at least StripeMin bytes on a session
// with several lanes is granted on every lane (Location.lanes), and its
// reader splits it into parts of at least StripePart bytes, one per lane,
// read at once.
const (
	StripeMin  = 8 << 20
	StripePart = 4 << 20
)

// Stripes is how many lanes a transfer of n bytes is split across.
func Stripes(n, lanes int) int {
	if lanes < 2 || n < StripeMin {
		return 1
	}
	return min(lanes, n/StripePart)
}

// GrantLanes grants a striped transfer's n bytes on every lane with
// grantOn (nil when it is not striped); lanes[at] reuses g, the grant on
// the lane the location is sent on. On error nothing stays granted but g.
func GrantLanes(lanes []*Link, at *Link, g verbs.Grant, n int, grantOn func(*Link) (verbs.Grant, error)) ([]verbs.Grant, []*pb.LaneRemote, error) {
	if Stripes(n, len(lanes)) < 2 {
		return nil, nil, nil
	}
	var extra []verbs.Grant
	remotes := make([]*pb.LaneRemote, len(lanes))
	for i, x := range lanes {
		lg := g
		if x != at {
			var err error
			if lg, err = grantOn(x); err != nil {
				RevokeAll(extra)
				return nil, nil, err
			}
			extra = append(extra, lg)
		}
		r := lg.Remote()
		remotes[i] = &pb.LaneRemote{RemoteKey: r.Key, Address: r.Addr}
	}
	return extra, remotes, nil
}

func RevokeAll(gs []verbs.Grant) {
	for _, g := range gs {
		g.Revoke()
	}
}

// joinEnds returns what each of n parts of a transfer calls once it has
// ended (ok: it succeeded): once all have, failed runs if any did not.
func joinEnds(n int, failed func()) func(ok bool) {
	var mu sync.Mutex
	left, bad := n, false
	return func(ok bool) {
		mu.Lock()
		left--
		bad = bad || !ok
		last, fail := left == 0, bad
		mu.Unlock()
		if last && fail {
			failed()
		}
	}
}

// ReadLanes reads local.Length bytes into local: from remote over l, or,
// when striped names a remote on each of lanes, in parts over every lane
// at once. On failure, or when ctx ends while reads are under way, failed
// runs once every read has completed (so local's memory is freed only
// then); it never runs after ReadLanes returns nil.
//
// On a session that compresses (l.Squeeze), a read of at least
// MinCompressed bytes asks for its data compressed as the session's mode,
// or ctx's (WithCodec), says: in auto mode with the plane's measured
// goodput, each lane told its share, after a probe of the first
// probeBytes as they are when nothing measured the plane yet.
func ReadLanes(ctx context.Context, l *Link, lanes []*Link, local verbs.Local, remote verbs.Remote, striped []*pb.LaneRemote, failed func()) error {
	z := l.Squeeze
	codec, goodput, probe, check := z.plan(ctx, local.Length)
	if codec == verbs.CodecNone && !check {
		_, err := postLanes(ctx, verbs.OpRead, l, lanes, local, remote, striped, 0, verbs.Compression{}, failed)
		return err
	}
	t0 := time.Now()
	rep := ReadReport{Bytes: local.Length, Asked: codec, Probed: probe, Checked: check}
	skip := 0
	if probe {
		pl := local
		pl.Length = probeBytes
		if _, err := l.postWait(ctx, verbs.SendRequest{Op: verbs.OpRead, Local: pl, Remote: remote}, failed, true, nil); err != nil {
			return err
		}
		z.observe(probeBytes, 0, time.Since(t0), false)
		goodput, skip = z.Goodput(), probeBytes
	}
	rep.Goodput = goodput
	t1 := time.Now()
	cs, err := postLanes(ctx, verbs.OpRead, l, lanes, local, remote, striped, skip, verbs.Compression{Codec: codec, Goodput: goodput}, failed)
	if err != nil {
		return err
	}
	rep.Wire = int64(skip)
	for _, c := range cs {
		rep.Sampled = max(rep.Sampled, c.Sampled)
		if c.Packed != verbs.CodecNone {
			rep.Packed = c.Packed
			rep.Wire += int64(c.Wire)
		} else {
			rep.Wire += int64(c.Len)
		}
	}
	if rep.Packed == verbs.CodecNone {
		z.observe(local.Length-skip, 0, time.Since(t1), true)
		z.noteSampled(&rep)
	} else {
		z.observe(local.Length-skip, rep.Wire-int64(skip), time.Since(t1), true)
	}
	rep.Took = time.Since(t0)
	if z.Report != nil {
		z.Report(ctx, rep)
	}
	return nil
}

// ReadPlanned is ReadLanes without waiting, for a read on l alone (not
// striped) that needs no probe: done runs with its error where
// completions are handled (see ReadAsync), after the read was measured
// and reported as ReadLanes does (ctx, which must not be cancelled, is
// the report's). It reports false, having posted nothing, where ReadAsync
// would, and where auto compression would probe first (the plane not
// measured yet, or due again).
func ReadPlanned(ctx context.Context, l *Link, local verbs.Local, remote verbs.Remote, done func(error)) bool {
	z := l.Squeeze
	codec, goodput, check, ok := z.planNoProbe(ctx, local.Length)
	if !ok {
		return false
	}
	if codec == verbs.CodecNone && !check {
		return l.ReadAsync(local, remote, done)
	}
	rep := ReadReport{Bytes: local.Length, Asked: codec, Checked: check, Goodput: goodput}
	t0 := time.Now()
	return l.readAsync(verbs.SendRequest{Op: verbs.OpRead, Local: local, Remote: remote, Compress: verbs.Compression{Codec: codec, Goodput: goodput}}, func(c verbs.Completion) {
		err := CompletionStatus(c)
		if err == nil {
			rep.Sampled = c.Sampled
			rep.Packed, rep.Wire = verbs.CodecNone, int64(c.Len)
			if c.Packed != verbs.CodecNone {
				rep.Packed, rep.Wire = c.Packed, int64(c.Wire)
			}
			if rep.Packed == verbs.CodecNone {
				z.observe(local.Length, 0, time.Since(t0), true)
				z.noteSampled(&rep)
			} else {
				z.observe(local.Length, rep.Wire, time.Since(t0), true)
			}
			rep.Took = time.Since(t0)
			if z.Report != nil {
				z.Report(ctx, rep)
			}
		}
		done(err)
	})
}

// WriteLanes is ReadLanes the other way: it writes local into remote (a
// destination the peer granted writable), striped over the lanes as
// ReadLanes reads. When it returns nil the bytes are in place at the
// peer (a Write completes when the target has applied it).
func WriteLanes(ctx context.Context, l *Link, lanes []*Link, local verbs.Local, remote verbs.Remote, striped []*pb.LaneRemote, failed func()) error {
	_, err := postLanes(ctx, verbs.OpWrite, l, lanes, local, remote, striped, 0, verbs.Compression{}, failed)
	return err
}

// postLanes posts op for local's bytes from skip on (and the same offset
// of remote, or of each lane's striped remote), on l or striped in parts
// over the lanes, and returns the completions. A Read's parts ask for cz,
// each lane told its share of cz.Goodput.
func postLanes(ctx context.Context, op verbs.Opcode, l *Link, lanes []*Link, local verbs.Local, remote verbs.Remote, striped []*pb.LaneRemote, skip int, cz verbs.Compression, failed func()) ([]verbs.Completion, error) {
	local.Offset += skip
	local.Length -= skip
	remote.Addr += uint64(skip)
	n := local.Length
	k := Stripes(n+skip, len(lanes))
	if len(striped) != len(lanes) || k < 2 {
		c, err := l.postWait(ctx, verbs.SendRequest{Op: op, Local: local, Remote: remote, Compress: cz}, failed, true, nil)
		return []verbs.Completion{c}, err
	}
	cz.Goodput /= float64(k)
	part := ((n+k-1)/k + 4095) &^ 4095 // k parts cover n
	done := joinEnds(k, failed)
	errs := make([]error, k)
	cs := make([]verbs.Completion, k)
	post := func(i int, wr verbs.SendRequest) {
		if cs[i], errs[i] = lanes[i].postWait(ctx, wr, func() { done(false) }, true, nil); errs[i] == nil {
			done(true)
		}
	}
	// Each part but the last is posted and waited for in a goroutine; the
	// last here.
	last := (n - 1) / part
	var wg sync.WaitGroup
	for i := range k {
		off := i * part
		m := min(part, n-off)
		if m <= 0 {
			done(true)
			continue
		}
		wr := verbs.SendRequest{Op: op,
			Local:    verbs.Local{Region: local.Region, Offset: local.Offset + off, Length: m},
			Remote:   verbs.Remote{Addr: striped[i].Address + uint64(skip+off), Key: striped[i].RemoteKey},
			Compress: cz}
		if i == last {
			post(i, wr)
			continue
		}
		wg.Go(func() { post(i, wr) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return cs, nil
}
