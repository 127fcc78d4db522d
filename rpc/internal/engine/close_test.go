package engine

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/pooltest"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// TestCloseWaitsForCloseUnderWay: a Close that finds another one under
// way returns only once that one has finished, so that what the link
// held (here an abandoned request's grant, freed by its late work) is
// released when any Close returns. A client that closes a session's
// lanes while a lane watcher is closing them relies on it.
func TestCloseWaitsForCloseUnderWay(t *testing.T) {
	ctl := pooltest.New(t, 1<<20)
	dev, err := OpenDomain(tcp.New(), pooltest.New(t, 1<<20), ctl)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	l, err := NewLink(context.Background(), dev, ctl, netip.Addr{}, verbs.RoleDial)
	if err != nil {
		t.Fatal(err)
	}
	l.EnableFrames(4096, nil, nil)
	pc := l.Frames.Expect(1, 0, nil)
	entered, finish, freed := make(chan struct{}), make(chan struct{}), make(chan struct{})
	l.Abandon(1, pc, func() {
		close(entered)
		<-finish
		close(freed)
	})
	first := make(chan struct{})
	go func() {
		l.Close(errors.New("first"))
		close(first)
	}()
	<-entered // the first Close is running the abandoned request's late work
	second := make(chan struct{})
	go func() {
		l.Close(errors.New("second"))
		close(second)
	}()
	select {
	case <-second:
		t.Fatal("a second Close returned while the first was still releasing what the link held")
	case <-time.After(50 * time.Millisecond):
	}
	close(finish)
	<-second
	select {
	case <-freed:
	default:
		t.Fatal("the second Close returned before the abandoned request's late work finished")
	}
	<-first
	leakcheck.Check(t)
}
