package softrc

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// SecretSize is the size of a queue pair's one-time secret.
const SecretSize = 16

// Secret is a queue pair's one-time secret: the peer presents it on the
// data connection, which binds the data plane to the control-plane session
// that carried the connection info.
type Secret [SecretSize]byte

// NewSecret returns a random secret.
func NewSecret() Secret {
	var s Secret
	rand.Read(s[:]) // never fails (it panics rather than return short output)
	return s
}

// Equal compares in constant time.
func (s *Secret) Equal(o Secret) bool {
	return subtle.ConstantTimeCompare(s[:], o[:]) == 1
}

// Bounded runs f, the dialer's side of a handshake on conn, so that ctx
// bounds it: ctx's deadline is conn's, and ctx ending interrupts f
// (through the deadline) and is then Bounded's error. conn has no
// deadline afterwards.
func Bounded(ctx context.Context, conn net.Conn, f func() error) error {
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	err := f()
	if !stop() {
		return context.Cause(ctx)
	}
	conn.SetDeadline(time.Time{})
	return err
}

// Dial opens the dialer's data connection to the peer at addr, within
// timeout (zero: none) and ctx, and runs hello, its side of the
// handshake, on it, bounded by ctx (see Bounded). On failure the
// connection is closed.
func (q *QP) Dial(ctx context.Context, network, addr string, timeout time.Duration, hello func(net.Conn) error) (net.Conn, error) {
	d := net.Dialer{Timeout: timeout}
	conn, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, q.Errorf("dialing the peer at %s: %w", addr, err)
	}
	if err := Bounded(ctx, conn, func() error { return hello(conn) }); err != nil {
		conn.Close()
		return nil, q.Errorf("handshake with %s: %w", addr, err)
	}
	return conn, nil
}

// ShouldDial says whether a queue pair with role mine and secret opens the
// data connection to a peer with role peer and secret theirs: RoleDial
// dials and RoleAccept accepts; RoleAny does the opposite of a peer with a
// role, and of two RoleAny sides the one with the smaller secret dials.
// Two RoleDial or two RoleAccept sides wrap verbs.ErrInvalidInfo.
func ShouldDial(mine, peer verbs.ConnectRole, secret, theirs Secret) (bool, error) {
	if mine != verbs.RoleAny && mine == peer {
		neither := map[verbs.ConnectRole]string{verbs.RoleDial: "accept", verbs.RoleAccept: "dial"}[mine]
		return false, fmt.Errorf("both sides have role %s, so neither would %s: %w", mine, neither, verbs.ErrInvalidInfo)
	}
	switch {
	case mine == verbs.RoleDial:
		return true, nil
	case mine == verbs.RoleAccept:
		return false, nil
	case peer == verbs.RoleAccept:
		return true, nil
	case peer == verbs.RoleDial:
		return false, nil
	}
	return bytes.Compare(secret[:], theirs[:]) < 0, nil
}

// Acceptor runs a domain's accept loops: every accepted connection goes to
// a handshake in its own goroutine, which keeps it (returns true) or has
// it closed. Close stops the loops, closes their listeners and the
// connections still in a handshake, and waits.
type Acceptor struct {
	// OnError, if not nil, hears of accept failures other than the
	// listener closing (the loop backs off and goes on).
	OnError func(ln net.Listener, err error)

	mu         sync.Mutex
	closed     bool
	listeners  []net.Listener
	handshakes map[net.Conn]struct{}
	wg         sync.WaitGroup
}

var errAcceptorClosed = errors.New("acceptor closed")

// Serve accepts connections on ln until Close.
func (a *Acceptor) Serve(ln net.Listener, handshake func(net.Conn) bool) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		ln.Close()
		return fmt.Errorf("%w: %w", errAcceptorClosed, verbs.ErrClosed)
	}
	if a.handshakes == nil {
		a.handshakes = make(map[net.Conn]struct{})
	}
	a.listeners = append(a.listeners, ln)
	a.wg.Add(1)
	go a.loop(ln, handshake)
	return nil
}

func (a *Acceptor) loop(ln net.Listener, handshake func(net.Conn) bool) {
	defer a.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			a.mu.Lock()
			closed := a.closed
			a.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return
			}
			if a.OnError != nil {
				a.OnError(ln, err)
			}
			// Out of fds or a similar transient failure: back off.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		a.mu.Lock()
		if a.closed {
			a.mu.Unlock()
			c.Close()
			return
		}
		a.handshakes[c] = struct{}{}
		a.wg.Add(1)
		a.mu.Unlock()
		go func() {
			defer a.wg.Done()
			kept := handshake(c)
			a.mu.Lock()
			delete(a.handshakes, c)
			a.mu.Unlock()
			if !kept {
				c.Close()
			}
		}()
	}
}

// Close stops accepting and waits for the loops and handshakes.
func (a *Acceptor) Close() {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return
	}
	a.closed = true
	for _, ln := range a.listeners {
		ln.Close()
	}
	for c := range a.handshakes {
		c.Close()
	}
	a.mu.Unlock()
	a.wg.Wait()
}
