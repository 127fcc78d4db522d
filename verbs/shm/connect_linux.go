package shm

import (
	"bytes"
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"golang.org/x/sys/unix"
)

// dialIn is a data connection whose hello named one of our queue pairs and
// presented its secret.
type dialIn struct {
	conn      *net.UnixConn
	hello     message
	stagingFD int
}

func (d dialIn) close() {
	d.conn.Close()
	closeFD(d.stagingFD)
}

func closeFD(fd int) {
	if fd >= 0 {
		unix.Close(fd)
	}
}

var errRefused = errors.New("shm: the peer refused the data connection (wrong secret, queue pair closed or already connected)")

func (qp *queuePair) isOwnSecret(s [16]byte) bool {
	return subtle.ConstantTimeCompare(s[:], qp.secret[:]) == 1
}

// offer hands a data connection to the queue pair if it still accepts one.
func (qp *queuePair) offer(d dialIn) bool {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.closed || !qp.accepting {
		return false
	}
	select {
	case qp.incoming <- d:
		return true
	default:
		return false
	}
}

func (qp *queuePair) drainIncoming() {
	for {
		select {
		case d := <-qp.incoming:
			d.close()
		default:
			return
		}
	}
}

// Connect connects to the peer queue pair whose LocalInfo is remote. The
// side with the smaller secret dials the other's socket and presents both
// secrets; the other accepts only that connection, once.
func (qp *queuePair) Connect(ctx context.Context, remote []byte) error {
	ri, err := parseInfo(remote)
	if err != nil {
		return err
	}
	if ri.hostID != qp.pd.hostID {
		return fmt.Errorf("shm: peer host identity %x, ours %x: %w", ri.hostID, qp.pd.hostID, ErrOtherHost)
	}
	if ri.secret == qp.secret {
		return invalidInfo("connection info is this queue pair's own")
	}
	dialer := bytes.Compare(qp.secret[:], ri.secret[:]) < 0

	qp.mu.Lock()
	switch {
	case qp.closed:
		qp.mu.Unlock()
		return verbs.ErrClosed
	case qp.state != verbs.QPReset:
		s := qp.state
		qp.mu.Unlock()
		return fmt.Errorf("shm: connect needs a queue pair in state RESET, this one is %v", s)
	}
	qp.state = verbs.QPInit
	// A dialer takes no connections; an acceptor has been taking them
	// since it was made, because its peer may dial before we get here.
	qp.accepting = !dialer
	qp.mu.Unlock()
	if dialer {
		qp.drainIncoming()
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(qp.ctx, cancel)()

	err = qp.connect(ctx, ri, dialer)
	if err != nil {
		qp.mu.Lock()
		if qp.state == verbs.QPInit || qp.state == verbs.QPReadyToReceive {
			qp.state = verbs.QPReset
			qp.accepting = !qp.closed
		}
		qp.mu.Unlock()
		if qp.ctx.Err() != nil {
			return verbs.ErrClosed
		}
	}
	return err
}

func (qp *queuePair) connect(ctx context.Context, ri connInfo, dialer bool) error {
	size := stagingHeader + qp.pd.opts.stagingSize
	stagingFD, staging, err := newSealedMemfd("tensorrpc-shm-staging", size)
	if err != nil {
		return err
	}
	stateWord(staging).Store(stateUp)
	// The mapping keeps the file alive; the peer gets its own fd.
	defer unix.Close(stagingFD)

	var conn *net.UnixConn
	var peerMapping, peerStaging []byte
	if dialer {
		conn, peerMapping, peerStaging, err = qp.dial(ctx, ri, stagingFD, size)
	} else {
		conn, peerMapping, peerStaging, err = qp.accept(ctx, ri, stagingFD, size)
	}
	if err != nil {
		unix.Munmap(staging)
		return err
	}

	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.closed {
		conn.Close()
		unix.Munmap(staging)
		unix.Munmap(peerMapping)
		return verbs.ErrClosed
	}
	qp.conn = conn
	qp.stagingMapping, qp.staging, qp.localState = staging, staging[stagingHeader:], stateWord(staging)
	qp.peerStagingMapping, qp.peerStaging, qp.peerState = peerMapping, peerStaging[stagingHeader:], stateWord(peerStaging)
	qp.state = verbs.QPReadyToSend
	qp.workerDone = make(chan struct{})
	qp.readerDone = make(chan struct{})
	go qp.runSender()
	go qp.runReceiver()
	return nil
}

// dial connects to the peer's socket, presents the secrets and our staging
// buffer, and waits for the welcome that carries the peer's.
func (qp *queuePair) dial(ctx context.Context, ri connInfo, stagingFD, size int) (conn *net.UnixConn, peerMapping, peerStaging []byte, err error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", ri.addr)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("shm: dial the peer's socket %s: %w", ri.addr, err)
	}
	uc := c.(*net.UnixConn)
	defer func() {
		if err != nil {
			uc.Close()
		}
	}()
	conn = uc
	hello := message{typ: msgHello, seq: ri.qpID, length: uint64(size)}
	hello.secret[0], hello.secret[1] = ri.secret, qp.secret
	if err := writeMessage(conn, &hello, stagingFD); err != nil {
		return nil, nil, nil, fmt.Errorf("shm: send hello: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetReadDeadline(time.Unix(1, 0)) })
	m, fd, err := readMessage(conn, newMsgBuffers())
	if !stop() {
		closeFD(fd)
		return nil, nil, nil, fmt.Errorf("shm: waiting for the peer's welcome: %w", context.Cause(ctx))
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil, nil, nil, errRefused
		}
		return nil, nil, nil, fmt.Errorf("shm: waiting for the peer's welcome: %w", err)
	}
	if m.typ != msgWelcome {
		closeFD(fd)
		return nil, nil, nil, fmt.Errorf("shm: peer answered hello with message type %d", m.typ)
	}
	peerMapping, peerStaging, err = mapPeerStaging(fd, m.length)
	closeFD(fd)
	if err != nil {
		return nil, nil, nil, err
	}
	return conn, peerMapping, peerStaging, nil
}

// accept waits for the dialer that presents the peer's secret, maps its
// staging buffer and welcomes it. Connections with any other secret are
// closed; once one is welcomed, no other is accepted.
func (qp *queuePair) accept(ctx context.Context, ri connInfo, stagingFD, size int) (conn *net.UnixConn, peerMapping, peerStaging []byte, err error) {
	for {
		var d dialIn
		select {
		case d = <-qp.incoming:
		case <-ctx.Done():
			return nil, nil, nil, fmt.Errorf("shm: waiting for the peer to connect: %w", context.Cause(ctx))
		}
		if subtle.ConstantTimeCompare(d.hello.secret[1][:], ri.secret[:]) != 1 {
			d.close()
			continue
		}
		qp.mu.Lock()
		qp.accepting = false
		qp.mu.Unlock()
		qp.drainIncoming()

		peerMapping, peerStaging, err = mapPeerStaging(d.stagingFD, d.hello.length)
		if err != nil {
			d.close()
			return nil, nil, nil, err
		}
		closeFD(d.stagingFD)
		welcome := message{typ: msgWelcome, length: uint64(size)}
		if err := writeMessage(d.conn, &welcome, stagingFD); err != nil {
			d.conn.Close()
			unix.Munmap(peerMapping)
			return nil, nil, nil, fmt.Errorf("shm: send welcome: %w", err)
		}
		return d.conn, peerMapping, peerStaging, nil
	}
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
}

func newMsgBuffers() *msgBuffers {
	// One byte more than a message, to detect longer ones; room for one fd.
	return &msgBuffers{data: make([]byte, messageSize+1), oob: make([]byte, unix.CmsgSpace(4))}
}

// readMessage reads one control message and the fd that came with it (-1
// if none). Extra fds are closed; the caller owns the one returned, also
// when it returns an error together with it.
func readMessage(c *net.UnixConn, bufs *msgBuffers) (message, int, error) {
	n, oobn, flags, _, err := c.ReadMsgUnix(bufs.data, bufs.oob)
	fd := -1
	if oobn > 0 {
		fd = takeFD(bufs.oob[:oobn])
	}
	if err != nil {
		closeFD(fd)
		return message{}, -1, err
	}
	if n == 0 {
		closeFD(fd)
		return message{}, -1, io.EOF
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		closeFD(fd)
		return message{}, -1, fmt.Errorf("shm: truncated control message (%d bytes, flags %#x)", n, flags)
	}
	m, err := decodeMessage(bufs.data[:n])
	if err != nil {
		closeFD(fd)
		return message{}, -1, err
	}
	return m, fd, nil
}

// takeFD returns the first fd passed in oob and closes any others.
func takeFD(oob []byte) int {
	fd := -1
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return -1
	}
	for i := range msgs {
		fds, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			continue
		}
		for _, f := range fds {
			if fd < 0 {
				fd = f
			} else {
				unix.Close(f)
			}
		}
	}
	return fd
}
