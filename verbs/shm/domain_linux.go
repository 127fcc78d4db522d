package shm

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
	"net"
	"path/filepath"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"golang.org/x/sys/unix"
)

// domain is a protection domain: the soft-RC core's domain (package
// softrc: the table of its registered regions and grants, which its queue
// pairs serve to their peers, completion queues, queue pairs, Close) with
// a listening unix socket on which its queue pairs accept their data
// connections.
type domain struct {
	*softrc.Domain
	opts   options
	hostID [16]byte
	ln     *net.UnixListener
	addr   string

	regions map[uint32]*region // by key; guarded by Mu
}

// attributes are the shm device's limits: requests run one at a time,
// but up to maxEarly Reads posted behind others may run ahead of their
// turn (queuePair.canReadEarlyLocked), and one more can be the request
// running.
var attributes = verbs.Attributes{
	MaxMessageBytes:     math.MaxInt64,
	MaxSegments:         softrc.MaxSegments,
	MaxInline:           0,
	MaxOutstandingReads: maxEarly + 1,
	MaxQueueDepth:       softrc.MaxQueueDepth,
	Grants:              verbs.GrantSoftware,
	RecvImmKey:          true,
}

func openDomain(opts options, hostID [16]byte) (*domain, error) {
	suffix := softrc.NewSecret() // random
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
	qpStart := softrc.NewSecret() // random
	pd := &domain{
		Domain:  softrc.NewDomain("shm", attributes, binary.LittleEndian.Uint64(qpStart[:8])),
		opts:    opts,
		hostID:  hostID,
		ln:      ln,
		addr:    name,
		regions: make(map[uint32]*region),
	}
	pd.Acceptor.Serve(ln, pd.handshake)
	return pd, nil
}

// handshake reads a dialer's hello and offers the connection to the queue
// pair it names if it presents that queue pair's secret; otherwise the
// connection is closed.
func (pd *domain) handshake(nc net.Conn) bool {
	return pd.Admit(nc, pd.opts.handshakeTimeout, func(nc net.Conn) (softrc.Offer, error) {
		c := nc.(*net.UnixConn)
		m, fds, err := readMessageFDs(c, newMsgBuffers())
		if err == nil && (m.typ != msgHello || fds[0] < 0) {
			fds.close()
			err = fmt.Errorf("shm: a data connection began with message type %d, not a hello with its staging buffer", m.typ)
		}
		c.SetDeadline(time.Time{})
		return dialIn{conn: c, hello: m, stagingFD: fds[0], ringFD: fds[1]}, err
	}) == nil
}

// RegisterMemory registers memory. Memory backed by a memfd must be
// sealed against shrinking: peers map it. Memory without an fd (a Go
// slice, a framework's array) is registered as it is, whatever its
// rights: this process copies it as the local side of its own work
// requests, and a peer reaches it (through its remote rights or a grant)
// by cross-memory attach, which works only where the peer's connection
// says so (CrossMemory): otherwise the peer's access fails, not the
// registration, which may well come before any connection.
func (pd *domain) RegisterMemory(m verbs.Memory, access verbs.Access) (verbs.MemoryRegion, error) {
	if m.DMABuf {
		return nil, fmt.Errorf("shm: DMA-BUF device memory cannot be shared through a memfd; stage it through host memory: %w", verbs.ErrInvalidMemory)
	}
	if len(m.Bytes) == 0 {
		return nil, fmt.Errorf("shm: memory is empty: %w", verbs.ErrInvalidMemory)
	}
	fd := -1
	if !m.HasFD {
		m.FDOffset = 0
	} else {
		if m.FDOffset < 0 {
			return nil, fmt.Errorf("shm: negative FDOffset %d: %w", m.FDOffset, verbs.ErrInvalidMemory)
		}
		if err := checkSealedFD(m.FD, uint64(m.FDOffset)+uint64(len(m.Bytes))); err != nil {
			return nil, fmt.Errorf("shm: %v: %w", err, verbs.ErrInvalidMemory)
		}
		// Keep our own descriptor so the region stays shareable even if
		// the caller closes FD early.
		var err error
		if fd, err = unix.FcntlInt(uintptr(m.FD), unix.F_DUPFD_CLOEXEC, 0); err != nil {
			return nil, fmt.Errorf("shm: dup memfd: %w", err)
		}
	}
	pd.Mu.Lock()
	defer pd.Mu.Unlock()
	core, err := pd.RegisterLocked(m, access, addressOf(m.Bytes)) // checks the access bits
	if err != nil {
		closeFD(fd)
		return nil, err
	}
	r := &region{Region: core, pd: pd, fd: fd, fdOffset: uint64(m.FDOffset)}
	pd.regions[r.LocalKey()] = r
	return r, nil
}

// announcement is what onMapRequest tells the peer about a key: its
// window and region and, for a grant, the region's exposure id and
// whether this is the region's first exposure to the peer (its fd must go
// along).
type announcement struct {
	w        softrc.Window
	r        *region
	exposure uint64
	fresh    bool
}

// announce looks up the remote key a request of qp's peer names (a region
// with remote rights, or a grant made on qp) and records that the peer is
// about to map it (for a grant: its region, whole), so that Deregister or
// Revoke will tell that peer. With exposed set it answers only for a grant
// whose region is already exposed to the peer, or has no memfd (nothing
// to expose: the peer copies it by cross-memory attach), and records
// nothing for any other key.
func (pd *domain) announce(qp *queuePair, key uint32, exposed bool) (announcement, error) {
	pd.Mu.Lock()
	defer pd.Mu.Unlock()
	w, err := pd.Table.Window(key, qp.QP)
	if err != nil {
		return announcement{}, err
	}
	r := pd.regions[w.Region.LocalKey()]
	if r == nil || r.Region != w.Region {
		return announcement{}, fmt.Errorf("region of remote key %#x is deregistered", key)
	}
	if r.fd < 0 && !qp.cma.taken {
		return announcement{}, fmt.Errorf("region of remote key %#x has no memfd, and the peer does not take part in cross-memory attach", key)
	}
	a := announcement{w: w, r: r}
	if w.Grant && r.fd >= 0 {
		id, ok := qp.exposures[r]
		if !ok && !exposed {
			qp.nextExposure++
			id = qp.nextExposure
			qp.exposures[r] = id
			a.fresh = true
		}
		a.exposure = id
	}
	if exposed && (!w.Grant || (a.exposure == 0 && r.fd >= 0)) {
		return announcement{}, fmt.Errorf("remote key %#x is not a grant on an exposed region or on memory without a memfd", key)
	}
	qp.announced[key] = r
	return a, nil
}

// message is the announcement as a message of type typ (a msgMapReply or
// a msgGrant) about key, and the fd that goes along (-1 for none). Memory
// without a memfd is marked flagCMA, with the virtual address of the
// window's first byte in this process as its offset.
func (a announcement) message(typ msgType, key uint32, seq uint64) (message, int) {
	m := message{typ: typ, flags: flagFound, key: key, seq: seq, addr: a.w.Addr, length: a.w.Len, access: a.w.Access}
	if a.r.fd < 0 {
		m.flags |= flagCMA
		m.offset = addressOf(a.r.Bytes()) + a.w.Off
		return m, -1
	}
	if !a.w.Grant {
		m.offset = a.r.fdOffset + a.w.Off
		return m, a.r.fd
	}
	m.flags |= flagRegion
	m.offset, m.total = a.w.Off, a.exposure
	m.setRegionRange(a.r.fdOffset, uint64(a.r.Len()))
	if a.fresh {
		return m, a.r.fd
	}
	return m, -1
}

// NewQueuePair makes a queue pair in RESET; its completion queues must
// have room for its MaxSend and MaxRecv besides the reservations of other
// queue pairs.
func (pd *domain) NewQueuePair(cfg verbs.QueuePairConfig) (verbs.QueuePair, error) {
	var qp *queuePair
	_, err := pd.NewQP(cfg, nil, true, func(core *softrc.QP) softrc.Wire {
		qp = newQueuePair(pd, core, cfg)
		qp.Info = softrc.Info{Host: pd.hostID, Secret: qp.Secret, QPID: qp.ID, Addr: pd.addr}.Encode(infoMagic)
		return qp
	})
	if err != nil {
		return nil, err
	}
	return qp, nil
}

// Close closes the listener, every queue pair, region and completion
// queue left, and waits for the domain's goroutines. It is idempotent.
func (pd *domain) Close() error {
	return pd.Domain.Close(func() {
		pd.Mu.Lock()
		regions := make([]*region, 0, len(pd.regions))
		for _, r := range pd.regions {
			regions = append(regions, r)
		}
		pd.Mu.Unlock()
		for _, r := range regions {
			r.Deregister()
		}
	})
}
