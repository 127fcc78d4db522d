package peerwatch

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// TestWatch: of two peers whose sessions end, the one still needed is
// reported, after Grace; the one that may go is not; a live one never is.
func TestWatch(t *testing.T) {
	defer leakcheck.Check(t)
	srv, err := rpc.NewServer(rpc.WithTransports(rpc.TransportGRPC))
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	defer func() {
		srv.Stop()
		<-served
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	name := func(id int) string { return fmt.Sprintf("peer-%d", id) }
	clients := map[int]*rpc.Client{}
	for id := range 3 {
		c, err := rpc.Dial(ctx, lis.Addr().String(), rpc.WithTransportCredentials(insecure.NewCredentials()),
			rpc.WithTransports(rpc.TransportGRPC), rpc.WithName(name(id)))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Fetch(ctx, "absent"); err == nil { // opens the session
			t.Fatal("fetched an absent key")
		}
		clients[id] = c
	}
	defer clients[2].Close()
	var asked atomic.Int32
	type report struct {
		id   int
		gone time.Duration
	}
	got := make(chan report, 1)
	start := time.Now()
	clients[0].Close() // may go
	clients[1].Close() // still needed
	Watch(ctx, srv, 20*time.Millisecond, Peers{
		IDs:  func() []int { return []int{0, 1, 2} },
		Name: name,
		Needed: func(id int) bool {
			asked.Add(1)
			return id == 1
		},
	}, func(id int, gone time.Duration) { got <- report{id, gone} })
	select {
	case r := <-got:
		if r.id != 1 || r.gone < Grace || time.Since(start) < Grace {
			t.Fatalf("reported peer %d gone for %v after %v; want peer 1, after %v", r.id, r.gone, time.Since(start), Grace)
		}
	default:
		t.Fatalf("Watch returned without a report: %v", ctx.Err())
	}
	if asked.Load() == 0 {
		t.Fatal("Needed was never asked")
	}
}
