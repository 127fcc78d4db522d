// Package granttest checks a software provider's grants
// (verbs.QueuePair.Grant): the key opens one range, one right, to the peer
// of one queue pair, until it is revoked, and refused accesses touch no
// memory.
package granttest

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/verbstest"
)

type side struct {
	pd verbs.ProtectionDomain
	cq verbs.CompletionQueue
}

type fixture struct {
	t        *testing.T
	a, b     side
	a1, b1   verbs.QueuePair // the granted pair
	a2, b2   verbs.QueuePair // another pair of the same domains
	src, dst verbs.MemoryRegion
}

func newFixture(t *testing.T, env verbstest.Env) *fixture {
	f := &fixture{t: t}
	pa, pb := env.Open(t)
	t.Cleanup(func() { pa.Close(); pb.Close() })
	f.a.pd, f.b.pd = pa, pb
	for _, s := range []*side{&f.a, &f.b} {
		cq, err := s.pd.NewCompletionQueue(64)
		if err != nil {
			t.Fatal(err)
		}
		s.cq = cq
	}
	f.a1, f.b1 = f.connect()
	f.a2, f.b2 = f.connect()
	var err error
	if f.src, err = pa.RegisterMemory(env.NewMemory(t, 1<<14), verbs.AccessLocalWrite); err != nil {
		t.Fatal(err)
	}
	// The target registers without remote rights: only grants open it.
	if f.dst, err = pb.RegisterMemory(env.NewMemory(t, 1<<14), verbs.AccessLocalWrite); err != nil {
		t.Fatal(err)
	}
	for i := range f.dst.Bytes() {
		f.dst.Bytes()[i] = byte(i * 7)
	}
	return f
}

func (f *fixture) connect() (verbs.QueuePair, verbs.QueuePair) {
	cfg := func(s side) verbs.QueuePairConfig {
		return verbs.QueuePairConfig{SendCQ: s.cq, RecvCQ: s.cq, MaxSend: 8, MaxRecv: 8}
	}
	qa, err := f.a.pd.NewQueuePair(cfg(f.a))
	if err != nil {
		f.t.Fatal(err)
	}
	qb, err := f.b.pd.NewQueuePair(cfg(f.b))
	if err != nil {
		f.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- qb.Connect(ctx, qa.LocalInfo()) }()
	if err := qa.Connect(ctx, qb.LocalInfo()); err != nil {
		f.t.Fatal(err)
	}
	if err := <-errc; err != nil {
		f.t.Fatal(err)
	}
	return qa, qb
}

// do posts one request on qp and returns its completion.
func (f *fixture) do(qp verbs.QueuePair, wr verbs.SendRequest) verbs.Completion {
	f.t.Helper()
	if err := qp.PostSend(wr); err != nil {
		f.t.Fatalf("PostSend: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var out [1]verbs.Completion
	for {
		if _, err := f.a.cq.Wait(ctx, out[:]); err != nil {
			f.t.Fatalf("waiting for a completion: %v", err)
		}
		if out[0].ID == wr.ID {
			return out[0]
		}
	}
}

func read(id uint64, f *fixture, r verbs.Remote, n int) verbs.SendRequest {
	return verbs.SendRequest{ID: id, Op: verbs.OpRead, Local: verbs.Local{Region: f.src, Length: n}, Remote: r}
}

func write(id uint64, f *fixture, r verbs.Remote, n int) verbs.SendRequest {
	return verbs.SendRequest{ID: id, Op: verbs.OpWrite, Local: verbs.Local{Region: f.src, Length: n}, Remote: r}
}

// Run runs the grant checks against the provider env describes.
func Run(t *testing.T, env verbstest.Env) {
	t.Run("ReadAndWrite", func(t *testing.T) {
		f := newFixture(t, env)
		g, err := f.b1.Grant(f.dst, 4096, 4096, verbs.AccessRemoteRead)
		if err != nil {
			t.Fatal(err)
		}
		if g.Len() != 4096 || g.Access() != verbs.AccessRemoteRead || g.Remote().Key == f.dst.RemoteKey() {
			t.Fatalf("grant: len %d access %v key %#x (region key %#x)", g.Len(), g.Access(), g.Remote().Key, f.dst.RemoteKey())
		}
		if c := f.do(f.a1, read(1, f, g.Remote(), 4096)); c.Status != verbs.StatusSuccess {
			t.Fatal(verbs.CompletionError(c))
		}
		if !bytes.Equal(f.src.Bytes()[:4096], f.dst.Bytes()[4096:8192]) {
			t.Fatal("the Read through the grant read other bytes")
		}
		w, err := f.b1.Grant(f.dst, 100, 50, verbs.AccessRemoteWrite)
		if err != nil {
			t.Fatal(err)
		}
		copy(f.src.Bytes(), bytes.Repeat([]byte{0xab}, 50))
		if c := f.do(f.a1, write(2, f, w.Remote(), 50)); c.Status != verbs.StatusSuccess {
			t.Fatal(verbs.CompletionError(c))
		}
		if !bytes.Equal(f.dst.Bytes()[100:150], bytes.Repeat([]byte{0xab}, 50)) || f.dst.Bytes()[150] != byte(150*7%256) {
			t.Fatal("the Write through the grant wrote other bytes")
		}
		if err := g.Revoke(); err != nil || g.Revoke() != nil {
			t.Fatal("Revoke is not idempotent")
		}
	})
	refused := []struct {
		name string
		run  func(f *fixture, g verbs.Grant) (verbs.QueuePair, verbs.SendRequest)
	}{
		{"PastTheRange", func(f *fixture, g verbs.Grant) (verbs.QueuePair, verbs.SendRequest) {
			r := g.Remote()
			r.Addr += uint64(g.Len()) - 8
			return f.a1, read(3, f, r, 16)
		}},
		{"BeforeTheRange", func(f *fixture, g verbs.Grant) (verbs.QueuePair, verbs.SendRequest) {
			r := g.Remote()
			r.Addr--
			return f.a1, read(3, f, r, 8)
		}},
		{"AnotherQueuePair", func(f *fixture, g verbs.Grant) (verbs.QueuePair, verbs.SendRequest) {
			return f.a2, read(3, f, g.Remote(), 8)
		}},
		{"TheOtherRight", func(f *fixture, g verbs.Grant) (verbs.QueuePair, verbs.SendRequest) {
			return f.a1, write(3, f, g.Remote(), 8)
		}},
		{"TheRegionKey", func(f *fixture, g verbs.Grant) (verbs.QueuePair, verbs.SendRequest) {
			return f.a1, read(3, f, verbs.Remote{Addr: g.Remote().Addr, Key: f.dst.RemoteKey()}, 8)
		}},
		{"Revoked", func(f *fixture, g verbs.Grant) (verbs.QueuePair, verbs.SendRequest) {
			if err := g.Revoke(); err != nil {
				f.t.Fatal(err)
			}
			return f.a1, read(3, f, g.Remote(), 8)
		}},
		{"RevokedAsync", func(f *fixture, g verbs.Grant) (verbs.QueuePair, verbs.SendRequest) {
			// Used once first, so that on shm the peer maps it and must
			// confirm the unmapping before done runs.
			if c := f.do(f.a1, read(4, f, g.Remote(), 8)); c.Status != verbs.StatusSuccess {
				f.t.Fatal(verbs.CompletionError(c))
			}
			for i := range 8 {
				f.src.Bytes()[i] = 0x5a // as the case found it: the refused Read must leave it so
			}
			a, ok := g.(verbs.AsyncRevoker)
			if !ok {
				f.t.Fatalf("%T is not a verbs.AsyncRevoker", g)
			}
			done := make(chan struct{})
			a.RevokeAsync(func() { close(done) })
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				f.t.Fatal("RevokeAsync's done never ran")
			}
			return f.a1, read(3, f, g.Remote(), 8)
		}},
		{"RevokedWrite", func(f *fixture, g verbs.Grant) (verbs.QueuePair, verbs.SendRequest) {
			w, err := f.b1.Grant(f.dst, 0, 64, verbs.AccessRemoteWrite)
			if err != nil {
				f.t.Fatal(err)
			}
			w.Revoke()
			return f.a1, write(3, f, w.Remote(), 8)
		}},
	}
	for _, rc := range refused {
		t.Run(rc.name, func(t *testing.T) {
			f := newFixture(t, env)
			g, err := f.b1.Grant(f.dst, 4096, 4096, verbs.AccessRemoteRead)
			if err != nil {
				t.Fatal(err)
			}
			before := bytes.Clone(f.dst.Bytes())
			for i := range f.src.Bytes() {
				f.src.Bytes()[i] = 0x5a
			}
			qp, wr := rc.run(f, g)
			c := f.do(qp, wr)
			if c.Status != verbs.StatusRemoteAccess {
				t.Fatalf("completion %v, want %v", verbs.CompletionError(c), verbs.StatusRemoteAccess)
			}
			if !bytes.Equal(f.dst.Bytes(), before) {
				t.Fatal("a refused access changed the target's memory")
			}
			for i, v := range f.src.Bytes() {
				if v != 0x5a {
					t.Fatalf("a refused Read changed local byte %d", i)
				}
			}
		})
	}
	t.Run("BadGrants", func(t *testing.T) {
		f := newFixture(t, env)
		other, err := f.a.pd.RegisterMemory(env.NewMemory(t, 4096), verbs.AccessLocalWrite)
		if err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			name   string
			mr     verbs.MemoryRegion
			off, n int
			access verbs.Access
		}{
			{"both rights", f.dst, 0, 8, verbs.AccessRemoteRead | verbs.AccessRemoteWrite},
			{"local write", f.dst, 0, 8, verbs.AccessLocalWrite},
			{"no right", f.dst, 0, 8, 0},
			{"past the end", f.dst, 1<<14 - 4, 8, verbs.AccessRemoteRead},
			{"negative offset", f.dst, -1, 8, verbs.AccessRemoteRead},
			{"negative length", f.dst, 0, -1, verbs.AccessRemoteRead},
			{"another domain", other, 0, 8, verbs.AccessRemoteRead},
			{"no region", nil, 0, 8, verbs.AccessRemoteRead},
		} {
			if g, err := f.b1.Grant(tc.mr, tc.off, tc.n, tc.access); !errors.Is(err, verbs.ErrInvalidMemory) {
				t.Errorf("%s: Grant = %v, %v; want an error wrapping ErrInvalidMemory", tc.name, g, err)
			}
		}
		// Keys are unique in the domain: a thousand grants, a thousand keys.
		keys := map[uint32]bool{f.dst.RemoteKey(): true}
		for range 1000 {
			g, err := f.b1.Grant(f.dst, 0, 8, verbs.AccessRemoteRead)
			if err != nil {
				t.Fatal(err)
			}
			if keys[g.Remote().Key] {
				t.Fatalf("key %#x handed out twice", g.Remote().Key)
			}
			keys[g.Remote().Key] = true
		}
		f.b1.Close()
		if _, err := f.b1.Grant(f.dst, 0, 8, verbs.AccessRemoteRead); !errors.Is(err, verbs.ErrClosed) {
			t.Fatalf("Grant on a closed queue pair: %v", err)
		}
	})
}
