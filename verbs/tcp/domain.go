package tcp

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// domain implements verbs.ProtectionDomain. It owns the listener that
// accepts the data connections of its queue pairs; an accepted connection
// is handed to the queue pair whose one-time secret it presents.
type domain struct {
	opts options

	mu         sync.Mutex
	closed     bool
	ln         net.Listener
	advertise  string
	nextQP     uint64
	qps        map[*queuePair]struct{}
	cqs        map[*completionQueue]struct{}
	waiting    map[secret]*queuePair // queue pairs whose secret is still unused
	handshakes map[net.Conn]struct{} // accepted connections not yet handed over
	wg         sync.WaitGroup        // the accept loop and handshakes

	regMu   sync.RWMutex
	regions map[uint32]*memoryRegion
}

func newDomain(opts options) *domain {
	return &domain{
		opts:       opts,
		qps:        make(map[*queuePair]struct{}),
		cqs:        make(map[*completionQueue]struct{}),
		waiting:    make(map[secret]*queuePair),
		handshakes: make(map[net.Conn]struct{}),
		regions:    make(map[uint32]*memoryRegion),
	}
}

func (d *domain) Provider() string { return Name }

func (d *domain) isClosed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.closed
}

// RegisterMemory registers m. The region's address is a random base chosen
// by the domain, not the memory's virtual address, and its key a random
// 32-bit number unique in the domain.
func (d *domain) RegisterMemory(m verbs.Memory, access verbs.Access) (verbs.MemoryRegion, error) {
	if access&^(verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead) != 0 {
		return nil, fmt.Errorf("tcp: register memory: unknown access bits %v: %w", access, verbs.ErrInvalidMemory)
	}
	if m.DMABuf {
		return nil, fmt.Errorf("tcp: register memory: %w: DMA-BUF device memory cannot be read by the CPU; stage it through host memory", verbs.ErrInvalidMemory)
	}
	if d.isClosed() {
		return nil, fmt.Errorf("tcp: register memory: domain: %w", verbs.ErrClosed)
	}
	r := &memoryRegion{pd: d, bytes: m.Bytes[:len(m.Bytes):len(m.Bytes)], access: access}
	r.cond.L = &r.mu
	var b [12]byte
	d.regMu.Lock()
	defer d.regMu.Unlock()
	for {
		if _, err := rand.Read(b[:]); err != nil {
			return nil, fmt.Errorf("tcp: register memory: choosing a key: %w", err)
		}
		r.key = binary.LittleEndian.Uint32(b[:4])
		if _, used := d.regions[r.key]; r.key != 0 && !used {
			break
		}
	}
	// A page-aligned base below 2^62 leaves room for any length without
	// overflowing the address space.
	r.addr = (binary.LittleEndian.Uint64(b[4:]) >> 2) &^ 0xfff
	d.regions[r.key] = r
	return r, nil
}

func (d *domain) removeRegion(r *memoryRegion) {
	d.regMu.Lock()
	if d.regions[r.key] == r {
		delete(d.regions, r.key)
	}
	d.regMu.Unlock()
}

// remoteAccess finds the span a peer names and takes a reference on its
// region. It checks key, rights and bounds before anything touches memory.
func (d *domain) remoteAccess(key uint32, addr, length uint64, right verbs.Access) (*memoryRegion, []byte, error) {
	d.regMu.RLock()
	r := d.regions[key]
	d.regMu.RUnlock()
	if r == nil {
		return nil, nil, fmt.Errorf("no region has remote key %#x", key)
	}
	if r.access&right == 0 {
		return nil, nil, fmt.Errorf("region %#x grants %v, not %v", key, r.access, right)
	}
	if addr < r.addr {
		return nil, nil, fmt.Errorf("address %#x is before region %#x at %#x", addr, key, r.addr)
	}
	buf, ok := r.span(addr-r.addr, length)
	if !ok {
		return nil, nil, fmt.Errorf("%d bytes at %#x exceed region %#x of %d bytes at %#x", length, addr, key, len(r.bytes), r.addr)
	}
	if !r.acquire() {
		return nil, nil, fmt.Errorf("region %#x is deregistered", key)
	}
	return r, buf, nil
}

// NewCompletionQueue makes a completion queue of the given capacity.
func (d *domain) NewCompletionQueue(capacity int) (verbs.CompletionQueue, error) {
	if capacity <= 0 {
		return nil, fmt.Errorf("tcp: completion queue capacity %d must be positive", capacity)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("tcp: new completion queue: domain: %w", verbs.ErrClosed)
	}
	q := newCompletionQueue(d, capacity)
	d.cqs[q] = struct{}{}
	return q, nil
}

func (d *domain) removeCQ(q *completionQueue) {
	d.mu.Lock()
	delete(d.cqs, q)
	d.mu.Unlock()
}

// NewQueuePair makes a queue pair in RESET. Its completion queues must
// belong to this domain and have room for MaxSend and MaxRecv outstanding
// requests besides those already reserved by other queue pairs.
func (d *domain) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	if d.isClosed() {
		return nil, fmt.Errorf("tcp: new queue pair: domain: %w", verbs.ErrClosed)
	}
	sendCQ, ok1 := cfg.SendCQ.(*completionQueue)
	recvCQ, ok2 := cfg.RecvCQ.(*completionQueue)
	if !ok1 || !ok2 || sendCQ == nil || recvCQ == nil || sendCQ.pd != d || recvCQ.pd != d {
		return nil, errors.New("tcp: new queue pair: SendCQ and RecvCQ must be completion queues of this domain")
	}
	if cfg.MaxSend < 0 || cfg.MaxRecv < 0 || cfg.MaxInline < 0 {
		return nil, fmt.Errorf("tcp: new queue pair: negative limits in %+v", cfg)
	}
	maxSend, maxRecv := cmpOr(cfg.MaxSend, 1024), cmpOr(cfg.MaxRecv, 1024)
	if err := d.ensureListener(); err != nil {
		return nil, err
	}
	if err := sendCQ.reserve(maxSend); err != nil {
		return nil, fmt.Errorf("tcp: new queue pair: send queue of %d: %w", maxSend, err)
	}
	if err := recvCQ.reserve(maxRecv); err != nil {
		sendCQ.unreserve(maxSend)
		return nil, fmt.Errorf("tcp: new queue pair: receive queue of %d: %w", maxRecv, err)
	}
	q := newQueuePair(d, sendCQ, recvCQ, maxSend, maxRecv, cmpOr(cfg.MaxInline, defaultMaxInline))
	if _, err := rand.Read(q.secret[:]); err != nil {
		sendCQ.unreserve(maxSend)
		recvCQ.unreserve(maxRecv)
		return nil, fmt.Errorf("tcp: new queue pair: choosing a secret: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		sendCQ.unreserve(maxSend)
		recvCQ.unreserve(maxRecv)
		return nil, fmt.Errorf("tcp: new queue pair: domain: %w", verbs.ErrClosed)
	}
	d.nextQP++
	q.id = d.nextQP
	q.info = (&info{secret: q.secret, qpID: q.id, addr: d.advertise}).encode()
	d.qps[q] = struct{}{}
	d.waiting[q.secret] = q
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

// ensureListener starts the domain's listener and accept loop once.
func (d *domain) ensureListener() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("tcp: new queue pair: domain: %w", verbs.ErrClosed)
	}
	if d.ln != nil {
		return nil
	}
	ln, err := net.Listen("tcp", d.opts.listenAddress)
	if err != nil {
		return fmt.Errorf("tcp: listening on %s: %w", d.opts.listenAddress, err)
	}
	adv, err := advertised(ln.Addr().(*net.TCPAddr), d.opts.advertiseAddress)
	if err != nil {
		ln.Close()
		return err
	}
	d.ln, d.advertise = ln, adv
	d.wg.Add(1)
	go d.acceptLoop(ln)
	return nil
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

func (d *domain) acceptLoop(ln net.Listener) {
	defer d.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			if d.isClosed() || errors.Is(err, net.ErrClosed) {
				return
			}
			slog.Warn("tcp: accepting a data connection", "listener", ln.Addr().String(), "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		d.mu.Lock()
		if d.closed {
			d.mu.Unlock()
			c.Close()
			return
		}
		d.handshakes[c] = struct{}{}
		d.wg.Add(1)
		d.mu.Unlock()
		go d.handshake(c)
	}
}

// handshake reads the dialer's hello and hands the connection to the queue
// pair that issued the secret it presents, or refuses it.
func (d *domain) handshake(c net.Conn) {
	defer d.wg.Done()
	handed := false
	defer func() {
		d.mu.Lock()
		delete(d.handshakes, c)
		d.mu.Unlock()
		if !handed {
			c.Close()
		}
	}()
	c.SetDeadline(time.Now().Add(d.opts.handshakeTimeout))
	h, err := readHello(c)
	if err != nil {
		slog.Debug("tcp: refusing a data connection", "remote", c.RemoteAddr().String(), "err", err)
		return
	}
	d.mu.Lock()
	q := d.waiting[h.acceptor]
	d.mu.Unlock()
	if q == nil || q.id != h.qpID || !q.offer(c, h) {
		slog.Debug("tcp: refusing a data connection with an unknown or used secret", "remote", c.RemoteAddr().String())
		c.Write(replyBytes(handshakeRefused))
		return
	}
	handed = true
}

// Close closes the listener, the queue pairs, the completion queues and the
// regions left in the domain, and waits for its goroutines to stop.
func (d *domain) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return fmt.Errorf("tcp: domain: %w", verbs.ErrClosed)
	}
	d.closed = true
	if d.ln != nil {
		d.ln.Close()
	}
	for c := range d.handshakes {
		c.Close()
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
	d.wg.Wait()
	for _, q := range qps {
		q.Close()
	}
	for _, q := range cqs {
		q.Close()
	}
	d.regMu.RLock()
	regions := make([]*memoryRegion, 0, len(d.regions))
	for _, r := range d.regions {
		regions = append(regions, r)
	}
	d.regMu.RUnlock()
	for _, r := range regions {
		r.Deregister()
	}
	return nil
}
