package shm

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"golang.org/x/sys/unix"
)

// domain is a protection domain. It owns a listening unix socket on which
// its queue pairs accept their data connections, and the table of its
// registered regions, which its queue pairs serve to their peers.
type domain struct {
	opts   options
	hostID [16]byte
	ln     *net.UnixListener
	addr   string

	mu         sync.Mutex
	closed     bool
	regions    map[uint32]*region // by key
	nextKey    uint32
	qps        map[uint64]*queuePair // by id
	nextQP     uint64
	cqs        map[*completionQueue]struct{}
	handshakes map[*net.UnixConn]struct{} // accepted, hello not read yet

	wg sync.WaitGroup // the accept loop and handshakes
}

func randomBytes(b []byte) {
	// crypto/rand.Read never fails on Linux (getrandom), and panics rather
	// than return short output.
	rand.Read(b)
}

func randomUint32() uint32 {
	var b [4]byte
	randomBytes(b[:])
	return binary.LittleEndian.Uint32(b[:])
}

func openDomain(opts options, hostID [16]byte) (*domain, error) {
	var suffix [16]byte
	randomBytes(suffix[:])
	name := opts.socketPrefix + hex.EncodeToString(suffix[:])
	if opts.socketDir != "" {
		name = filepath.Join(opts.socketDir, name+".sock")
		if !filepath.IsAbs(name) {
			abs, err := filepath.Abs(name)
			if err != nil {
				return nil, fmt.Errorf("shm: socket dir: %w", err)
			}
			name = abs
		}
	} else {
		name = "@" + name
	}
	if len(name) > maxAddrLen {
		return nil, fmt.Errorf("shm: socket address %q is longer than %d bytes", name, maxAddrLen)
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: name, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("shm: listen on %s: %w", name, err)
	}
	var qpStart [8]byte
	randomBytes(qpStart[:])
	pd := &domain{
		opts:       opts,
		hostID:     hostID,
		ln:         ln,
		addr:       name,
		regions:    make(map[uint32]*region),
		nextKey:    randomUint32(),
		qps:        make(map[uint64]*queuePair),
		nextQP:     binary.LittleEndian.Uint64(qpStart[:]),
		cqs:        make(map[*completionQueue]struct{}),
		handshakes: make(map[*net.UnixConn]struct{}),
	}
	pd.wg.Add(1)
	go pd.acceptLoop()
	return pd, nil
}

func (pd *domain) Provider() string { return "shm" }

// acceptLoop accepts data connections and hands each to a handshake.
func (pd *domain) acceptLoop() {
	defer pd.wg.Done()
	for {
		c, err := pd.ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of fds or a similar transient failure: back off so as
			// not to spin, and stop if the domain closed meanwhile.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		pd.mu.Lock()
		if pd.closed {
			pd.mu.Unlock()
			c.Close()
			return
		}
		pd.handshakes[c] = struct{}{}
		pd.wg.Add(1)
		pd.mu.Unlock()
		go pd.handshake(c)
	}
}

// handshake reads a dialer's hello and hands the connection to the queue
// pair it names if it presents that queue pair's secret; otherwise it
// closes the connection.
func (pd *domain) handshake(c *net.UnixConn) {
	defer pd.wg.Done()
	handed := false
	defer func() {
		pd.mu.Lock()
		delete(pd.handshakes, c)
		pd.mu.Unlock()
		if !handed {
			c.Close()
		}
	}()
	c.SetReadDeadline(time.Now().Add(pd.opts.handshakeTimeout))
	m, fds, err := readMessageFDs(c, newMsgBuffers())
	if err != nil {
		return
	}
	if m.typ != msgHello || fds[0] < 0 {
		fds.close()
		return
	}
	pd.mu.Lock()
	qp := pd.qps[m.seq]
	pd.mu.Unlock()
	if qp == nil || !qp.isOwnSecret(m.secret[0]) {
		fds.close()
		return
	}
	c.SetReadDeadline(time.Time{})
	if !qp.offer(dialIn{conn: c, hello: m, stagingFD: fds[0], ringFD: fds[1]}) {
		fds.close()
		return
	}
	handed = true
}

// RegisterMemory registers memfd-backed memory. It refuses memory without
// an fd and memfds that are not sealed against shrinking.
func (pd *domain) RegisterMemory(m verbs.Memory, access verbs.Access) (verbs.MemoryRegion, error) {
	if m.DMABuf {
		return nil, fmt.Errorf("shm: DMA-BUF device memory cannot be shared through a memfd; stage it through host memory: %w", verbs.ErrInvalidMemory)
	}
	if !m.HasFD {
		return nil, fmt.Errorf("shm: memory must be backed by a memfd (Memory.HasFD is false): %w", verbs.ErrInvalidMemory)
	}
	if len(m.Bytes) == 0 {
		return nil, fmt.Errorf("shm: memory is empty: %w", verbs.ErrInvalidMemory)
	}
	if m.FDOffset < 0 {
		return nil, fmt.Errorf("shm: negative FDOffset %d: %w", m.FDOffset, verbs.ErrInvalidMemory)
	}
	if access&^(verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead) != 0 {
		return nil, fmt.Errorf("shm: unknown access bits in %v: %w", access, verbs.ErrInvalidMemory)
	}
	if err := checkSealedFD(m.FD, uint64(m.FDOffset)+uint64(len(m.Bytes))); err != nil {
		return nil, fmt.Errorf("shm: %v: %w", err, verbs.ErrInvalidMemory)
	}
	// Keep our own descriptor so the region stays shareable even if the
	// caller closes FD early.
	fd, err := unix.FcntlInt(uintptr(m.FD), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: dup memfd: %w", err)
	}
	r := &region{
		pd:       pd,
		mem:      m.Bytes,
		addr:     addressOf(m.Bytes),
		access:   access,
		fd:       fd,
		fdOffset: uint64(m.FDOffset),
	}
	pd.mu.Lock()
	defer pd.mu.Unlock()
	if pd.closed {
		unix.Close(fd)
		return nil, verbs.ErrClosed
	}
	for {
		pd.nextKey++
		if k := pd.nextKey; k != 0 && pd.regions[k] == nil {
			r.key = k
			break
		}
	}
	pd.regions[r.key] = r
	return r, nil
}

// lookupRegionFor returns the live region with key and records that qp's
// peer is about to learn of it, so Deregister will tell that peer.
func (pd *domain) lookupRegionFor(qp *queuePair, key uint32) *region {
	pd.mu.Lock()
	defer pd.mu.Unlock()
	r := pd.regions[key]
	if r != nil {
		qp.announced[key] = struct{}{}
	}
	return r
}

func (pd *domain) NewCompletionQueue(capacity int) (verbs.CompletionQueue, error) {
	if capacity <= 0 {
		return nil, fmt.Errorf("shm: completion queue capacity %d must be positive", capacity)
	}
	cq := newCompletionQueue(pd, capacity)
	pd.mu.Lock()
	defer pd.mu.Unlock()
	if pd.closed {
		return nil, verbs.ErrClosed
	}
	pd.cqs[cq] = struct{}{}
	return cq, nil
}

func (pd *domain) forgetCQ(cq *completionQueue) {
	pd.mu.Lock()
	delete(pd.cqs, cq)
	pd.mu.Unlock()
}

func (pd *domain) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	pd.mu.Lock()
	closed := pd.closed
	pd.mu.Unlock()
	if closed {
		return nil, verbs.ErrClosed
	}
	sendCQ, ok1 := cfg.SendCQ.(*completionQueue)
	recvCQ, ok2 := cfg.RecvCQ.(*completionQueue)
	if !ok1 || !ok2 || sendCQ == nil || recvCQ == nil {
		return nil, errors.New("shm: queue pair needs send and receive completion queues made by the shm provider")
	}
	if sendCQ.pd != pd || recvCQ.pd != pd {
		return nil, errors.New("shm: completion queues belong to another protection domain")
	}
	if cfg.MaxSend < 0 || cfg.MaxRecv < 0 {
		return nil, fmt.Errorf("shm: negative queue size (MaxSend %d, MaxRecv %d)", cfg.MaxSend, cfg.MaxRecv)
	}
	qp := newQueuePair(pd, sendCQ, recvCQ, cfg)
	pd.mu.Lock()
	defer pd.mu.Unlock()
	if pd.closed {
		return nil, verbs.ErrClosed
	}
	for {
		pd.nextQP++
		if pd.qps[pd.nextQP] == nil {
			qp.id = pd.nextQP
			break
		}
	}
	qp.info = connInfo{hostID: pd.hostID, secret: qp.secret, qpID: qp.id, addr: pd.addr}.marshal()
	pd.qps[qp.id] = qp
	return qp, nil
}

func (pd *domain) forgetQP(qp *queuePair) {
	pd.mu.Lock()
	if pd.qps[qp.id] == qp {
		delete(pd.qps, qp.id)
	}
	pd.mu.Unlock()
}

// Close closes the listener, every queue pair, completion queue and region
// left, and waits for the domain's goroutines.
func (pd *domain) Close() error {
	pd.mu.Lock()
	if pd.closed {
		pd.mu.Unlock()
		return nil
	}
	pd.closed = true
	var qps []*queuePair
	for _, qp := range pd.qps {
		qps = append(qps, qp)
	}
	for c := range pd.handshakes {
		c.Close()
	}
	pd.mu.Unlock()

	pd.ln.Close()
	for _, qp := range qps {
		qp.Close()
	}
	pd.wg.Wait()

	pd.mu.Lock()
	var regions []*region
	for _, r := range pd.regions {
		regions = append(regions, r)
	}
	var cqs []*completionQueue
	for cq := range pd.cqs {
		cqs = append(cqs, cq)
	}
	pd.mu.Unlock()
	for _, r := range regions {
		r.Deregister()
	}
	for _, cq := range cqs {
		cq.Close()
	}
	return nil
}
