package rpc

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"math"
	"net"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// Admission is the budget of what clients may make a Server hold, per
// peer and in total, as grpc-go's MaxConcurrentStreams and gRPC's resource
// quota bound a server: a peer is a client host (the address of its gRPC
// connection, without the port) and, under TLS, its certificate. A request
// over a budget is refused at once with ResourceExhausted, naming the
// budget; it never waits for memory. A zero field keeps its default
// (DefaultAdmission); a negative one removes that budget.
//
// The per-peer budgets are well under the totals, so one abusive peer
// holds at most its own budget and a new client from another host can
// always connect. Several processes on one host share that host's
// budgets: raise the per-peer ones for a host that runs many clients.
type Admission struct {
	// SessionsPerPeer and Sessions bound the sessions open or
	// negotiating (default 64 and 1024).
	SessionsPerPeer, Sessions int
	// LanesPerPeer and Lanes bound the data-plane lanes (queue pairs, each
	// with frameSlots posted receive slots from the control pool: 640 KiB
	// at the default eager threshold). A session past a lane budget gets
	// the lanes left; with none left, ResourceExhausted. Defaults 64 and
	// 192 (192 lanes of slots fill half the control pool at the default
	// eager threshold; whatever the budget, slots never take more than
	// half of it).
	LanesPerPeer, Lanes int
	// StreamsPerPeer and Streams bound the fallback streams under way
	// (FetchStream, SendStream, CallStream; default 64 and 1024).
	StreamsPerPeer, Streams int
	// StreamBytesPerPeer and StreamBytes bound the pool memory fallback
	// streams hold: the tensors a SendStream or CallStream declares,
	// charged in full before it is allocated, and the reply a FetchStream
	// or CallStream is sending, until it is sent (default 2 GiB, two
	// tensors of DefaultMaxTensorBytes, and 3 GiB, less than
	// DefaultPoolLimit so that sessions keep some of the pool).
	StreamBytesPerPeer, StreamBytes int64
	// TransfersPerSession bounds the transfers a session holds unreleased
	// (fetched and leased tensors, call replies, destinations), each with
	// its grant, a memory window on ibv (default 4096).
	TransfersPerSession int
	// IdleSession ends a session that made no call and held no transfer
	// for that long (default 10 minutes); the Client opens a new session
	// on its next call, as after any session's end.
	IdleSession time.Duration
}

// DefaultAdmission is the budget a Server admits clients within unless
// WithAdmission says otherwise.
var DefaultAdmission = Admission{
	SessionsPerPeer: 64, Sessions: 1024,
	LanesPerPeer: 64, Lanes: 192,
	StreamsPerPeer: 64, Streams: 1024,
	StreamBytesPerPeer: 2 * DefaultMaxTensorBytes, StreamBytes: 3 * DefaultMaxTensorBytes,
	TransfersPerSession: 4096,
	IdleSession:         10 * time.Minute,
}

// WithAdmission sets the Server's budgets (see Admission): fields left
// zero keep DefaultAdmission's values, negative ones remove the budget.
func WithAdmission(a Admission) ServerOption {
	return serverOption(func(o *options) { o.admission = a })
}

// effective is a with DefaultAdmission's values for its zero fields and
// no bound (0) for its negative ones.
func (a Admission) effective() Admission {
	d := DefaultAdmission
	pick := func(v, def int64) int64 {
		switch {
		case v < 0:
			return 0
		case v == 0:
			return def
		}
		return v
	}
	i := func(v, def int) int { return int(pick(int64(v), int64(def))) }
	return Admission{
		SessionsPerPeer: i(a.SessionsPerPeer, d.SessionsPerPeer), Sessions: i(a.Sessions, d.Sessions),
		LanesPerPeer: i(a.LanesPerPeer, d.LanesPerPeer), Lanes: i(a.Lanes, d.Lanes),
		StreamsPerPeer: i(a.StreamsPerPeer, d.StreamsPerPeer), Streams: i(a.Streams, d.Streams),
		StreamBytesPerPeer: pick(a.StreamBytesPerPeer, d.StreamBytesPerPeer), StreamBytes: pick(a.StreamBytes, d.StreamBytes),
		TransfersPerSession: i(a.TransfersPerSession, d.TransfersPerSession),
		IdleSession:         time.Duration(pick(int64(a.IdleSession), int64(d.IdleSession))),
	}
}

// Admission returns the budgets the Server admits clients within (zero:
// no bound).
func (s *Server) Admission() Admission { return s.adm.limits }

// peerIdentity names the client host of ctx's call: the host of its gRPC
// connection's address and, under TLS, its certificate.
func peerIdentity(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	id := p.Addr.String()
	if host, _, err := net.SplitHostPort(id); err == nil {
		id = host
	}
	if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.PeerCertificates) > 0 {
		sum := sha256.Sum256(ti.State.PeerCertificates[0].Raw)
		id += "|" + hex.EncodeToString(sum[:])
	}
	return id
}

// admission counts what the peers hold against the budgets.
type admission struct {
	limits Admission

	mu    sync.Mutex
	total usage
	peers map[string]*usage
}

// usage is what one peer, or all of them, holds.
type usage struct {
	sessions, lanes, streams int
	streamBytes              int64
}

func newAdmission(a Admission) *admission {
	return &admission{limits: a.effective(), peers: map[string]*usage{}}
}

// peerLocked is the usage of peer, made on first use.
func (a *admission) peerLocked(peer string) *usage {
	u := a.peers[peer]
	if u == nil {
		u = &usage{}
		a.peers[peer] = u
	}
	return u
}

// dropLocked forgets a peer that holds nothing.
func (a *admission) dropLocked(peer string, u *usage) {
	if *u == (usage{}) {
		delete(a.peers, peer)
	}
}

// over reports whether held+n passes limit (0: no limit).
func over[T int | int64](held, n, limit T) bool { return limit > 0 && held+n > limit }

// refusal is the ResourceExhausted error of a request over a budget.
func refusal(what, budget string, held, limit any) error {
	return status.Errorf(codes.ResourceExhausted, "tensorrpc: %s refused: %v of the server's %s budget of %v are held (rpc.WithAdmission's Admission.%s raises it)", what, held, budget, limit, budget)
}

// budget is one of the budgets counted per peer and in total: the
// counter of a usage it charges, its limits and the Admission fields that
// set them (for the refusal's message).
type budget[T int | int64] struct {
	what             string
	count            func(*usage) *T
	perPeer, total   T
	perName, totName string
	format           func(T) any
}

// take charges n of b to peer; give (idempotent) takes them back.
func take[T int | int64](a *admission, peer string, b budget[T], n T) (give func(), err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	u := a.peerLocked(peer)
	held, total := b.count(u), b.count(&a.total)
	switch {
	case over(*held, n, b.perPeer):
		err = refusal(b.what, b.perName, b.format(*held), b.format(b.perPeer))
	case over(*total, n, b.total):
		err = refusal(b.what, b.totName, b.format(*total), b.format(b.total))
	}
	if err != nil {
		a.dropLocked(peer, u)
		return nil, err
	}
	*held += n
	*total += n
	var once sync.Once
	return func() {
		once.Do(func() {
			a.mu.Lock()
			defer a.mu.Unlock()
			*held -= n
			*total -= n
			a.dropLocked(peer, u)
		})
	}, nil
}

func asIs[T int | int64](n T) any { return n }

// session admits a new session of peer; done ends it.
func (a *admission) session(peer string) (done func(), err error) {
	return take(a, peer, budget[int]{"session", func(u *usage) *int { return &u.sessions },
		a.limits.SessionsPerPeer, a.limits.Sessions, "SessionsPerPeer", "Sessions", asIs[int]}, 1)
}

// lanes grants peer up to want lanes, fewer when a budget is nearly spent;
// when it grants none, err names the budget. Give them back with
// freeLanes.
func (a *admission) lanes(peer string, want int) (granted int, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	u := a.peerLocked(peer)
	granted = want
	if l := a.limits.LanesPerPeer; l > 0 {
		granted = min(granted, l-u.lanes)
		if granted <= 0 {
			err = refusal("data plane lane", "LanesPerPeer", u.lanes, l)
		}
	}
	if l := a.limits.Lanes; l > 0 && err == nil {
		granted = min(granted, l-a.total.lanes)
		if granted <= 0 {
			err = refusal("data plane lane", "Lanes", a.total.lanes, l)
		}
	}
	if err != nil {
		a.dropLocked(peer, u)
		return 0, err
	}
	u.lanes += granted
	a.total.lanes += granted
	return granted, nil
}

func (a *admission) freeLanes(peer string, n int) {
	if n == 0 {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	u := a.peerLocked(peer)
	u.lanes -= n
	a.total.lanes -= n
	a.dropLocked(peer, u)
}

// stream admits a fallback stream of peer; done ends it.
func (a *admission) stream(peer string) (done func(), err error) {
	return take(a, peer, budget[int]{"stream", func(u *usage) *int { return &u.streams },
		a.limits.StreamsPerPeer, a.limits.Streams, "StreamsPerPeer", "Streams", asIs[int]}, 1)
}

// streamBytes charges n bytes a fallback stream of peer holds; refund
// gives them back.
func (a *admission) streamBytes(peer string, n int64) (refund func(), err error) {
	return take(a, peer, budget[int64]{"stream of " + byteCount(n).String(), func(u *usage) *int64 { return &u.streamBytes },
		a.limits.StreamBytesPerPeer, a.limits.StreamBytes, "StreamBytesPerPeer", "StreamBytes", func(n int64) any { return byteCount(n) }}, n)
}

// byteCount prints n bytes for a message.
type byteCount int64

func (n byteCount) String() string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return itoa(int64(n)>>30) + " GiB"
	case n >= 1<<20 && n%(1<<20) == 0:
		return itoa(int64(n)>>20) + " MiB"
	}
	return itoa(int64(n)) + " bytes"
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// heldLanes is the lanes admitted in all.
func (a *admission) heldLanes() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.total.lanes
}

// refuse counts n refused (sessions, lanes, ...) and logs a request
// refused over a budget, and returns its error.
func (s *Server) refuse(counter interface{ Add(int64) int64 }, n int, peer string, err error) error {
	counter.Add(int64(n))
	s.log.Info("tensorrpc: refused over budget", "peer", peer, "reason", status.Convert(err).Message())
	return err
}

// admitStream admits a fallback stream of ctx's peer; done ends it.
func (s *Server) admitStream(ctx context.Context) (peer string, done func(), err error) {
	peer = peerIdentity(ctx)
	done, err = s.adm.stream(peer)
	if err != nil {
		return peer, nil, s.refuse(&s.refused.refusedStreams, 1, peer, err)
	}
	return peer, done, nil
}

// chargeStream charges the bytes of metas, which a fallback stream of peer
// is about to hold, to the stream byte budgets; refund gives them back.
// metas are checked first, so that a tensor over a limit fails as it
// would without budgets.
func (s *Server) chargeStream(peer string, metas []*pb.TensorMeta) (refund func(), err error) {
	var n int64
	for _, m := range metas {
		if err := checkMeta(m, s.opts.maxTensorBytes); err != nil {
			return nil, err
		}
		n = min(n+int64(m.ByteLength), math.MaxInt64/2) // each is under the limit; the sum saturates
	}
	return s.chargeBytes(peer, n)
}

// chargeBytes is chargeStream for n bytes.
func (s *Server) chargeBytes(peer string, n int64) (refund func(), err error) {
	refund, err = s.adm.streamBytes(peer, n)
	if err != nil {
		return nil, s.refuse(&s.refused.refusedStreams, 1, peer, err)
	}
	return refund, nil
}
