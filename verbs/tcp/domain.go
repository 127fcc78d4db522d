package tcp

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// domain implements verbs.ProtectionDomain. It owns the listeners that
// accept the data connections of its queue pairs, one per local address;
// an accepted connection is handed to the queue pair whose one-time secret
// it presents. Regions, grants, completion queues and the access checks
// are the soft-RC core's (package softrc).
type domain struct {
	opts     options
	table    *softrc.Table
	acceptor softrc.Acceptor

	mu        sync.Mutex
	closed    bool
	listeners map[string]*listener // by listen address
	nextQP    uint64
	qps       map[*queuePair]struct{}
	cqs       map[*completionQueue]struct{}
	waiting   map[secret]*queuePair // queue pairs whose secret is still unused
}

// completionQueue is the core's completion queue.
type completionQueue = softrc.CQ

func newDomain(opts options) *domain {
	d := &domain{
		opts:      opts,
		listeners: make(map[string]*listener),
		qps:       make(map[*queuePair]struct{}),
		cqs:       make(map[*completionQueue]struct{}),
		waiting:   make(map[secret]*queuePair),
	}
	d.table = softrc.NewTable(d)
	d.acceptor.OnError = func(ln net.Listener, err error) {
		d.opts.logger.Warn("tcp: accepting a data connection", "listener", ln.Addr().String(), "err", err)
	}
	return d
}

func (d *domain) Provider() string { return Name }

// attributes are the tcp device's limits: a work request's length is
// bounded by the frame's length field; Reads, like every request, are
// bounded only by the send queue.
var attributes = verbs.Attributes{
	MaxMessageBytes:     maxFrameLength,
	MaxSegments:         softrc.MaxSegments,
	MaxInline:           maxInline,
	MaxOutstandingReads: softrc.MaxQueueDepth,
	MaxQueueDepth:       softrc.MaxQueueDepth,
	Grants:              verbs.GrantSoftware,
	RecvImmKey:          true,
}

var limits = softrc.LimitsOf(attributes)

func (d *domain) Attributes() verbs.Attributes { return attributes }

func (d *domain) isClosed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.closed
}

// RegisterMemory registers m. The region's address is a random base chosen
// by the domain, not the memory's virtual address, and its key a random
// 32-bit number unique in the domain.
func (d *domain) RegisterMemory(m verbs.Memory, access verbs.Access) (verbs.MemoryRegion, error) {
	if d.isClosed() {
		return nil, fmt.Errorf("tcp: register memory: domain: %w", verbs.ErrClosed)
	}
	r, err := d.table.Register(m, access, 0)
	if err != nil {
		return nil, fmt.Errorf("tcp: %w", err)
	}
	return &memoryRegion{Region: r, pd: d}, nil
}

// NewCompletionQueue makes a completion queue of the given capacity.
func (d *domain) NewCompletionQueue(capacity int) (verbs.CompletionQueue, error) {
	return softrc.NewDomainCQ("tcp", d, capacity, &d.mu, &d.closed, d.cqs)
}

// NewQueuePair makes a queue pair in RESET. Its completion queues must
// belong to this domain and have room for MaxSend and MaxRecv outstanding
// requests besides those already reserved by other queue pairs. Unless its
// role is RoleDial, it uses the domain's listener for its local address
// (see listenFor), which it starts when it is the first to use it.
func (d *domain) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	var advertise string
	res, err := softrc.Reserve("tcp", d, d.isClosed(), cfg, func() error {
		if cfg.MaxInline > maxInline {
			return fmt.Errorf("tcp: new queue pair: MaxInline %d exceeds the device's %d: %w", cfg.MaxInline, maxInline, verbs.ErrTooLarge)
		}
		if cfg.Role > verbs.RoleAccept {
			return fmt.Errorf("tcp: new queue pair: unknown role %v", cfg.Role)
		}
		if cfg.Role != verbs.RoleDial {
			l, err := d.listenerFor(cfg.LocalAddress.Unmap())
			if err != nil {
				return err
			}
			advertise = l.advertise
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	q := newQueuePair(d, res.SendCQ, res.RecvCQ, res.MaxSend, res.MaxRecv, cmpOr(cfg.MaxInline, defaultMaxInline))
	q.role, q.advertise = cfg.Role, advertise
	q.secret = softrc.NewSecret()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		res.Release()
		return nil, fmt.Errorf("tcp: new queue pair: domain: %w", verbs.ErrClosed)
	}
	d.nextQP++
	q.id = d.nextQP
	q.info = (&info{role: q.role, secret: q.secret, qpID: q.id, addr: q.advertise}).encode()
	d.qps[q] = struct{}{}
	if q.role != verbs.RoleDial {
		// A dialing queue pair accepts nothing: no connection may
		// present its secret.
		d.waiting[q.secret] = q
	}
	return q, nil
}

func cmpOr(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

func (d *domain) removeQP(q *queuePair) {
	d.mu.Lock()
	delete(d.qps, q)
	if d.waiting[q.secret] == q {
		delete(d.waiting, q.secret)
	}
	d.mu.Unlock()
}

// forget retires a queue pair's secret: no further connection may present
// it.
func (d *domain) forget(q *queuePair) {
	d.mu.Lock()
	if d.waiting[q.secret] == q {
		delete(d.waiting, q.secret)
	}
	d.mu.Unlock()
}

// listener is one of a domain's listeners.
type listener struct {
	ln        net.Listener
	advertise string // the address peers dial, as carried in LocalInfo
}

// listenFor is the address a queue pair whose control connection has the
// local address local listens on, and where that choice came from: an
// explicit listen address (WithListenAddress, else TENSORRPC_TCP_ADDR),
// else the TENSORRPC_SOCKET_IFNAME interface's address, else local, else
// 127.0.0.1. An explicit address with a wildcard host gives only its port
// when an interface or local address is known.
func (o *options) listenFor(local netip.Addr) (addr, from string) {
	port := "0"
	if o.listenAddress != "" {
		host, p, _ := net.SplitHostPort(o.listenAddress) // checked by New
		if !isWildcard(host) {
			return o.listenAddress, o.listenFrom
		}
		if p != "" {
			port = p
		}
	}
	switch {
	case o.ifAddr.IsValid():
		return net.JoinHostPort(o.ifAddr.String(), port), fmt.Sprintf("interface %s from %s=%q", o.ifName, EnvSocketIfname, o.ifSpec)
	case local.IsValid() && !local.IsUnspecified():
		return net.JoinHostPort(local.String(), port), "the queue pair's LocalAddress"
	case o.listenAddress != "":
		return o.listenAddress, o.listenFrom
	}
	return "127.0.0.1:0", "the default"
}

// checkReachable refuses to offer a loopback address to a peer reached
// over a control connection whose local address is not loopback: that
// peer is on another host and cannot dial it.
func (o *options) checkReachable(local netip.Addr, listen, from string) error {
	if !local.IsValid() || local.IsUnspecified() || local.IsLoopback() {
		return nil
	}
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		host = listen
	}
	if o.advertiseAddress != "" {
		from = "tcp.WithAdvertiseAddress"
		if host, _, err = net.SplitHostPort(o.advertiseAddress); err != nil {
			host = strings.TrimSuffix(strings.TrimPrefix(o.advertiseAddress, "["), "]")
		}
	}
	if !isLoopbackHost(host) {
		return nil
	}
	return fmt.Errorf("tcp: new queue pair: the control connection's local address %s is not loopback, but the data plane would advertise the loopback host %s (from %s), which a peer on another host cannot reach; "+
		"give a reachable address with tcp.WithListenAddress or tcp.WithAdvertiseAddress, or set %s to the interface to use (or %s to the address)",
		local, host, from, EnvSocketIfname, EnvAddr)
}

// isLoopbackHost reports whether a host name or address is loopback.
func isLoopbackHost(host string) bool {
	h := strings.ToLower(strings.TrimSuffix(host, "."))
	if h == "localhost" || strings.HasSuffix(h, ".localhost") {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.Unmap().IsLoopback()
}

// listenerFor returns the domain's listener for a queue pair whose control
// connection has the local address local, and starts it and its accept
// loop if it is the first.
func (d *domain) listenerFor(local netip.Addr) (*listener, error) {
	addr, from := d.opts.listenFor(local)
	if err := d.opts.checkReachable(local, addr, from); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("tcp: new queue pair: domain: %w", verbs.ErrClosed)
	}
	if l := d.listeners[addr]; l != nil {
		return l, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("tcp: new queue pair: listening on %s (%s): %w", addr, from, err)
	}
	adv, err := advertised(ln.Addr().(*net.TCPAddr), d.opts.advertiseAddress)
	if err != nil {
		ln.Close()
		return nil, err
	}
	if err := d.acceptor.Serve(ln, d.handshake); err != nil {
		return nil, fmt.Errorf("tcp: new queue pair: domain: %w", err)
	}
	l := &listener{ln: ln, advertise: adv}
	d.listeners[addr] = l
	return l, nil
}

// advertised is the address peers dial: adv with the listener's port when
// adv has none, or the listener's own address.
func advertised(la *net.TCPAddr, adv string) (string, error) {
	if adv == "" {
		return la.String(), nil
	}
	if _, _, err := net.SplitHostPort(adv); err != nil {
		adv = net.JoinHostPort(adv, strconv.Itoa(la.Port))
	}
	if len(adv) > 255 {
		return "", fmt.Errorf("tcp: advertise address %q is longer than 255 bytes", adv)
	}
	return adv, nil
}

// handshake reads the dialer's hello and hands the connection to the queue
// pair that issued the secret it presents, or refuses it.
func (d *domain) handshake(c net.Conn) bool {
	c.SetDeadline(time.Now().Add(d.opts.handshakeTimeout))
	h, err := readHello(c)
	if err != nil {
		d.opts.logger.Debug("tcp: refusing a data connection", "remote", c.RemoteAddr().String(), "err", err)
		return false
	}
	d.mu.Lock()
	q := d.waiting[h.acceptor]
	d.mu.Unlock()
	if q == nil || q.id != h.qpID || !q.offer(c, h) {
		d.opts.logger.Debug("tcp: refusing a data connection with an unknown or used secret", "remote", c.RemoteAddr().String())
		c.Write(replyBytes(handshakeRefused))
		return false
	}
	return true
}

// Close closes the listeners, the queue pairs, the completion queues and the
// regions left in the domain, and waits for its goroutines to stop. It is
// idempotent.
func (d *domain) Close() error {
	if !softrc.BeginClose(&d.mu, &d.closed) {
		return nil
	}
	qps := make([]*queuePair, 0, len(d.qps))
	for q := range d.qps {
		qps = append(qps, q)
	}
	cqs := make([]*completionQueue, 0, len(d.cqs))
	for q := range d.cqs {
		cqs = append(cqs, q)
	}
	d.mu.Unlock()
	d.acceptor.Close()
	for _, q := range qps {
		q.Close()
	}
	for _, q := range cqs {
		q.Close()
	}
	for _, r := range d.table.Regions() {
		d.table.Deregister(r)
	}
	return nil
}
