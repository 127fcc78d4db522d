package shm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"golang.org/x/sys/unix"
)

// dialIn is a data connection whose hello named one of our queue pairs and
// presented its secret.
type dialIn struct {
	conn      *net.UnixConn
	hello     message
	stagingFD int
	ringFD    int // the dialer's control ring, -1 if it offers none
}

func (d dialIn) Hello() softrc.Hello {
	return softrc.Hello{QPID: d.hello.seq, Acceptor: d.hello.secret[0], Dialer: d.hello.secret[1]}
}

func (d dialIn) Close() {
	d.conn.Close()
	closeFD(d.stagingFD)
	closeFD(d.ringFD)
}

func closeFD(fd int) {
	if fd >= 0 {
		unix.Close(fd)
	}
}

var errRefused = errors.New("shm: the peer refused the data connection (wrong secret, queue pair closed or already connected)")

// Connect connects to the peer queue pair whose LocalInfo is remote. The
// side with the smaller secret dials the other's socket and presents both
// secrets; the other accepts only that connection, once.
func (qp *queuePair) Connect(ctx context.Context, remote []byte) error {
	ri, err := parseInfo(remote)
	if err != nil {
		return err
	}
	if ri.Host != qp.pd.hostID {
		return qp.Errorf("peer host identity %x, ours %x: %w", ri.Host, qp.pd.hostID, ErrOtherHost)
	}
	// shm has no roles: the side with the smaller secret dials.
	return qp.QP.Connect(ctx, ri.Secret, verbs.RoleAny, verbs.RoleAny, func(ctx context.Context, dial bool) (start, abort func(), err error) {
		return qp.connect(ctx, ri, dial)
	})
}

// link is what a handshake sets up besides our own staging buffer: the
// connection, the peer's staging buffer, when both ends use them, the
// control rings, and what it decided about cross-memory attach.
type link struct {
	conn                     *net.UnixConn
	peerMapping, peerStaging []byte
	rx                       *ringRx
	tx                       *ringTx
	cma                      cmaLink
}

func (l *link) release() {
	if l.conn != nil {
		l.conn.Close()
	}
	if l.peerMapping != nil {
		unix.Munmap(l.peerMapping)
	}
	l.rx.release()
	l.tx.release()
	l.cma.release()
}

func (qp *queuePair) connect(ctx context.Context, ri softrc.Info, dialer bool) (start, abort func(), err error) {
	size := stagingHeader + qp.pd.opts.stagingSize
	stagingFD, staging, err := newSealedMemfd("tensorrpc-shm-staging", size)
	if err != nil {
		return nil, nil, err
	}
	wordAt(staging, 0).Store(stateUp)
	// The mapping keeps the file alive; the peer gets its own fd.
	defer unix.Close(stagingFD)

	l := link{cma: cmaLink{pidfd: -1}}
	if dialer {
		err = qp.dial(ctx, ri, stagingFD, size, &l)
	} else {
		err = qp.accept(ctx, ri, stagingFD, size, &l)
	}
	if err != nil {
		l.release()
		unix.Munmap(staging)
		return nil, nil, err
	}
	l.rx.closeFD() // the peer has its own
	start = func() {
		qp.conn = l.conn
		qp.stagingMapping, qp.staging, qp.localState = staging, staging[stagingHeader:], wordAt(staging, 0)
		qp.peerStagingMapping, qp.peerStaging, qp.peerState = l.peerMapping, l.peerStaging[stagingHeader:], wordAt(l.peerStaging, 0)
		qp.rx, qp.tx = l.rx, l.tx
		qp.cma = l.cma
		qp.inProcess.Store(peerIsThisProcess(l.conn))
		qp.readerDone = make(chan struct{})
		receive := qp.runReceiver
		if qp.rx != nil {
			receive = qp.runRingReceiver
		}
		qp.Start(l.conn, qp.runSender, receive)
	}
	abort = func() {
		l.release()
		unix.Munmap(staging)
	}
	return start, abort, nil
}

// dial connects to the peer's socket, presents the secrets, our staging
// buffer, (unless told not to) the control ring we will consume and our
// probe, and waits for the welcome that carries the peer's staging buffer
// and, if it takes up the rings, its control ring; then it probes the
// peer's memory and tells it how that went.
func (qp *queuePair) dial(ctx context.Context, ri softrc.Info, stagingFD, size int, l *link) error {
	hello := message{typ: msgHello, flags: flagCMA, seq: ri.QPID, length: uint64(size), addr: qp.probeAddr()}
	hello.secret[0], hello.secret[1] = ri.Secret, qp.Secret
	ringFD := -1
	if !qp.pd.opts.socketControl {
		var err error
		if l.rx, err = newRingRx(); err != nil {
			return err
		}
		hello.flags |= flagRing
		ringFD = l.rx.fd
	}
	c, err := qp.Dial(ctx, "unixpacket", ri.Addr, 0, func(c net.Conn) error {
		if err := writeMessage(c.(*net.UnixConn), &hello, stagingFD, ringFD); err != nil {
			return fmt.Errorf("send hello: %w", err)
		}
		m, fds, err := readMessageFDs(c.(*net.UnixConn), newMsgBuffers())
		defer fds.close()
		switch {
		case errors.Is(err, io.EOF):
			return errRefused
		case err != nil:
			return err
		case m.typ != msgWelcome:
			return fmt.Errorf("shm: peer answered hello with message type %d", m.typ)
		}
		if l.peerMapping, l.peerStaging, err = mapPeerStaging(fds[0], m.length); err != nil {
			return err
		}
		switch {
		case m.flags&flagRing == 0:
			// The peer keeps control messages on the socket.
			l.rx.release()
			l.rx = nil
		case l.rx == nil:
			return errors.New("shm: the peer took up control rings we did not offer")
		default:
			l.tx, err = attachRingTx(fds[1])
		}
		if err != nil {
			return err
		}
		return qp.cmaDialer(c.(*net.UnixConn), m, ri.Secret, l)
	})
	if err == nil {
		l.conn = c.(*net.UnixConn)
	}
	return err
}

// accept waits for the dialer that presents the peer's secret, maps its
// staging buffer (and its control ring, if it offers one and we are not
// told to keep to the socket), probes its memory and welcomes it, then
// waits to hear how its probe of ours went. Connections with any other
// secret are closed; once one is welcomed, no other is accepted.
func (qp *queuePair) accept(ctx context.Context, ri softrc.Info, stagingFD, size int, l *link) error {
	o, err := qp.AcceptOffer(ctx, ri.Secret)
	if err != nil {
		return err
	}
	d := o.(dialIn)
	l.conn = d.conn
	defer closeFD(d.stagingFD)
	defer closeFD(d.ringFD)
	l.peerMapping, l.peerStaging, err = mapPeerStaging(d.stagingFD, d.hello.length)
	if err != nil {
		return err
	}
	welcome := message{typ: msgWelcome, length: uint64(size)}
	cma := d.hello.flags&flagCMA != 0
	if cma {
		var p cmaProbe
		l.cma, p = qp.pd.opts.probe(l.conn, d.hello.addr, ri.Secret)
		welcome.flags |= flagCMA
		welcome.addr, welcome.imm, welcome.key = qp.probeAddr(), uint32(p.code), uint32(p.errno)
	} else {
		l.cma = notTaken("the peer's shm provider does not take part in it")
	}
	ringFD := -1
	if d.hello.flags&flagRing != 0 && !qp.pd.opts.socketControl {
		if l.tx, err = attachRingTx(d.ringFD); err != nil {
			return err
		}
		if l.rx, err = newRingRx(); err != nil {
			return err
		}
		welcome.flags |= flagRing
		ringFD = l.rx.fd
	}
	if err := writeMessage(l.conn, &welcome, stagingFD, ringFD); err != nil {
		return qp.Errorf("send welcome: %w", err)
	}
	if cma {
		if err := softrc.Bounded(ctx, l.conn, func() error { return cmaAcceptor(l) }); err != nil {
			return qp.Errorf("handshake: %w", err)
		}
	}
	return nil
}

// cmaDialer ends the dialer's handshake: when the welcome says the
// acceptor takes part in cross-memory attach, it probes the acceptor's
// memory and tells it the outcome (msgCMA), and takes the outcome of the
// acceptor's probe from the welcome.
func (qp *queuePair) cmaDialer(c *net.UnixConn, welcome message, peerSecret [16]byte, l *link) error {
	if welcome.flags&flagCMA == 0 {
		l.cma = notTaken("the peer's shm provider does not take part in it")
		return nil
	}
	var p cmaProbe
	l.cma, p = qp.pd.opts.probe(c, welcome.addr, peerSecret)
	l.cma.peerReach = cmaError(told(welcome.imm, welcome.key), l.cma.peer, false)
	m := message{typ: msgCMA, imm: uint32(p.code), key: uint32(p.errno)}
	if err := writeMessage(c, &m); err != nil {
		return fmt.Errorf("send the cross-memory attach probe: %w", err)
	}
	return nil
}

// cmaAcceptor reads the dialer's msgCMA, the outcome of its probe of our
// memory, which ends the handshake.
func cmaAcceptor(l *link) error {
	m, fds, err := readMessageFDs(l.conn, newMsgBuffers())
	carried := fds[0] >= 0
	fds.close()
	switch {
	case errors.Is(err, io.EOF):
		return errNoCMAMessage
	case err != nil:
		return err
	case m.typ != msgCMA:
		return fmt.Errorf("shm: the dialer answered the welcome with message type %d, not the outcome of its cross-memory attach probe", m.typ)
	case carried:
		return errors.New("shm: the dialer's cross-memory attach probe carried an fd")
	}
	l.cma.peerReach = cmaError(told(m.imm, m.key), l.cma.peer, false)
	return nil
}

func mapPeerStaging(fd int, size uint64) (mapping, data []byte, err error) {
	if fd < 0 {
		return nil, nil, errors.New("shm: the peer sent no staging buffer")
	}
	if size <= stagingHeader || size > stagingHeader+maxStagingSize {
		return nil, nil, fmt.Errorf("shm: peer staging buffer of %d bytes is out of range %d..%d", size, stagingHeader+1, stagingHeader+maxStagingSize)
	}
	if err := checkSealedFD(fd, size); err != nil {
		return nil, nil, fmt.Errorf("shm: peer staging buffer: %v", err)
	}
	mapping, data, err = mapFD(fd, 0, size, false)
	if err != nil {
		return nil, nil, fmt.Errorf("shm: peer staging buffer: %v", err)
	}
	return mapping, data, nil
}

// msgBuffers are a reader's buffers, reused across messages.
type msgBuffers struct {
	data []byte
	oob  []byte
	// pendingFD is the fd of record pendingSeq that awaitWake read before
	// its record was drained (-1: none); readFD takes it.
	pendingFD  int
	pendingSeq uint64
}

func newMsgBuffers() *msgBuffers {
	// One byte more than a message, to detect longer ones; room for two
	// fds (a hello's staging buffer and control ring).
	return &msgBuffers{data: make([]byte, messageSize+1), oob: make([]byte, unix.CmsgSpace(8)), pendingFD: -1}
}

// passedFDs are the fds that came with a message, -1 where none did.
type passedFDs [2]int

func (f passedFDs) close() {
	closeFD(f[0])
	closeFD(f[1])
}

// readMessage reads one control message and the fd that came with it (-1
// if none). Extra fds are closed; the caller owns the one returned, also
// when it returns an error together with it.
func readMessage(c *net.UnixConn, bufs *msgBuffers) (message, int, error) {
	m, fds, err := readMessageFDs(c, bufs)
	closeFD(fds[1])
	return m, fds[0], err
}

// readMessageFDs reads one control message and up to two fds that came
// with it. Extra fds are closed; the caller owns the ones returned.
func readMessageFDs(c *net.UnixConn, bufs *msgBuffers) (message, passedFDs, error) {
	none := passedFDs{-1, -1}
	n, oobn, flags, _, err := c.ReadMsgUnix(bufs.data, bufs.oob)
	fds := none
	if oobn > 0 {
		fds = takeFDs(bufs.oob[:oobn])
	}
	if err != nil {
		fds.close()
		return message{}, none, err
	}
	if n == 0 {
		fds.close()
		return message{}, none, io.EOF
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		fds.close()
		return message{}, none, fmt.Errorf("shm: truncated control message (%d bytes, flags %#x)", n, flags)
	}
	m, err := decodeMessage(bufs.data[:n])
	if err != nil {
		fds.close()
		return message{}, none, err
	}
	return m, fds, nil
}

// takeFDs returns the first two fds passed in oob and closes any others.
func takeFDs(oob []byte) passedFDs {
	got := passedFDs{-1, -1}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return got
	}
	n := 0
	for i := range msgs {
		fds, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			continue
		}
		for _, f := range fds {
			if n < len(got) {
				got[n] = f
				n++
			} else {
				unix.Close(f)
			}
		}
	}
	return got
}
