package tcp

import (
	"cmp"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// domain implements verbs.ProtectionDomain with the soft-RC core's domain
// (package softrc: regions, grants, completion queues, queue pairs, the
// access checks and Close). It adds the listeners that accept the data
// connections of its queue pairs, one per local address; an accepted
// connection is offered to the queue pair whose id and one-time secret it
// presents.
type domain struct {
	*softrc.Domain
	opts options

	listeners map[string]*listener // by listen address; guarded by Mu
}

func newDomain(opts options) *domain {
	d := &domain{Domain: softrc.NewDomain(Name, attributes, 0), opts: opts, listeners: make(map[string]*listener)}
	d.Acceptor.OnError = func(ln net.Listener, err error) {
		d.opts.logger.Warn("tcp: accepting a data connection", "listener", ln.Addr().String(), "err", err)
	}
	return d
}

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

// RegisterMemory registers m as a region of the core (softrc.Region:
// every transfer into or out of its bytes holds a reference while the
// data moves, and Deregister waits for those references to go). The
// region's address is a random base chosen by the domain, not the
// memory's virtual address, and its key a random 32-bit number unique in
// the domain.
func (d *domain) RegisterMemory(m verbs.Memory, access verbs.Access) (verbs.MemoryRegion, error) {
	d.Mu.Lock()
	defer d.Mu.Unlock()
	r, err := d.RegisterLocked(m, access, 0)
	if err != nil {
		return nil, err // not a nil *Region in an interface
	}
	return r, nil
}

// NewQueuePair makes a queue pair in RESET. Its completion queues must
// belong to this domain and have room for MaxSend and MaxRecv outstanding
// requests besides those already reserved by other queue pairs. Unless its
// role is RoleDial, it uses the domain's listener for its local address
// (see listenFor), which it starts when it is the first to use it; a
// dialing queue pair accepts nothing: no connection may present its
// secret.
func (d *domain) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	var advertise string
	var q *queuePair
	_, err := d.NewQP(cfg, func() error {
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
	}, cfg.Role != verbs.RoleDial, func(core *softrc.QP) softrc.Wire {
		q = newQueuePair(d, core, cmp.Or(cfg.MaxInline, defaultMaxInline))
		q.role, q.advertise = cfg.Role, advertise
		q.Info = softrc.Info{Role: q.role, Secret: q.Secret, QPID: q.ID, Addr: q.advertise}.Encode(infoMagic)
		return q
	})
	if err != nil {
		return nil, err
	}
	return q, nil
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
	d.Mu.Lock()
	defer d.Mu.Unlock()
	if d.ClosedLocked() {
		return nil, d.ErrClosed("new queue pair")
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
	if err := d.Acceptor.Serve(ln, d.handshake); err != nil {
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

// handshake reads the dialer's hello and offers the connection to the
// queue pair that issued the secret it presents, or refuses it.
func (d *domain) handshake(c net.Conn) bool {
	err := d.Admit(c, d.opts.handshakeTimeout, func(c net.Conn) (softrc.Offer, error) {
		h, err := readHello(c)
		return offered{c, h}, err
	})
	if err != nil {
		d.opts.logger.Debug("tcp: refusing a data connection", "remote", c.RemoteAddr().String(), "err", err)
	}
	return err == nil
}

// Close closes the listeners, the queue pairs, the regions and the
// completion queues left in the domain, and waits for its goroutines to
// stop. It is idempotent.
func (d *domain) Close() error { return d.Domain.Close(d.DeregisterAll) }
