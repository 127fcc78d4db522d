package tcp

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// newConfiguredQP opens a domain of p with one queue pair made with cfg
// (its completion queues are filled in).
func newConfiguredQP(t *testing.T, p verbs.Provider, cfg verbs.QueuePairConfig) (*domain, *queuePair) {
	t.Helper()
	pd, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	cq, err := pd.NewCompletionQueue(4096)
	if err != nil {
		pd.Close()
		t.Fatal(err)
	}
	cfg.SendCQ, cfg.RecvCQ = cq, cq
	qp, err := pd.NewQueuePair(cfg)
	if err != nil {
		pd.Close()
		t.Fatal(err)
	}
	return pd.(*domain), qp.(*queuePair)
}

// setSecret replaces an unconnected queue pair's secret, so that a test
// can decide which side the smaller-secret rule would pick.
func setSecret(q *queuePair, s secret) {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	q.Secret = s
	q.Info = softrc.Info{Role: q.role, Secret: s, QPID: q.ID, Addr: q.advertise}.Encode(infoMagic)
}

var (
	smallSecret = secret{secretSize - 1: 1}
	largeSecret = secret{0: 0xff, secretSize - 1: 0xff}
)

// connectPair connects a and b concurrently.
func connectPair(t *testing.T, a, b *queuePair) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- b.Connect(ctx, a.LocalInfo()) }()
	errA := a.Connect(ctx, b.LocalInfo())
	errB := <-done
	if errA != nil || errB != nil {
		t.Fatalf("connect: %v; %v", errA, errB)
	}
}

// dialed reports whether q opened its connection: its peer's end is the
// listener the peer advertised.
func dialed(q, peer *queuePair) bool {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	return peer.advertise != "" && q.ConnLocked().RemoteAddr().String() == peer.advertise
}

// exchange sends 8 bytes from a to b and checks they arrive.
func exchange(t *testing.T, a, b *queuePair) {
	t.Helper()
	src, err := a.pd.RegisterMemory(verbs.Memory{Bytes: []byte("8 bytes!")}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Deregister()
	dst, err := b.pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 8)}, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Deregister()
	if err := b.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: dst, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	if err := a.PostSend(verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: src, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out := make([]verbs.Completion, 1)
	for _, cq := range []*softrc.CQ{a.SendCQ, b.RecvCQ} {
		if n, err := cq.Wait(ctx, out); err != nil || n != 1 || out[0].Status != verbs.StatusSuccess {
			t.Fatalf("completion %v, %v", out[:n], err)
		}
	}
	if string(dst.Bytes()) != "8 bytes!" {
		t.Fatalf("received %q", dst.Bytes())
	}
}

func TestRoleDialAccept(t *testing.T) {
	defer leakcheck.Check(t)
	p := New()
	pdD, d := newConfiguredQP(t, p, verbs.QueuePairConfig{Role: verbs.RoleDial})
	defer pdD.Close()
	pdA, a := newConfiguredQP(t, p, verbs.QueuePairConfig{Role: verbs.RoleAccept})
	defer pdA.Close()
	// By secrets alone the accepting side would dial.
	setSecret(d, largeSecret)
	setSecret(a, smallSecret)

	in, err := parseInfo(d.LocalInfo())
	if err != nil || in.Role != verbs.RoleDial || in.Addr != "" {
		t.Fatalf("the dialing queue pair's info: %+v, %v; want role dial and no address", in, err)
	}
	if n := len(pdD.listeners); n != 0 {
		t.Fatalf("a domain with only a dialing queue pair has %d listeners", n)
	}
	if in, _ := parseInfo(a.LocalInfo()); in.Role != verbs.RoleAccept || !strings.HasPrefix(in.Addr, "127.0.0.1:") {
		t.Fatalf("the accepting queue pair's info: %+v", in)
	}
	connectPair(t, d, a)
	if !dialed(d, a) {
		t.Fatal("the RoleDial queue pair did not dial")
	}
	exchange(t, d, a)
	exchange(t, a, d)
}

func TestRoleAnyMeetsRole(t *testing.T) {
	cases := []struct {
		name           string
		roleX, roleY   verbs.ConnectRole
		secretX        secret // the rule of secrets alone would make Y dial
		secretY        secret
		wantXDials     bool
		wantXDialsDesc string
	}{
		{"AnyAccept", verbs.RoleAny, verbs.RoleAccept, largeSecret, smallSecret, true, "the RoleAny side dials a RoleAccept peer"},
		{"DialAny", verbs.RoleDial, verbs.RoleAny, largeSecret, smallSecret, true, "a RoleDial side dials a RoleAny peer"},
		{"AnyDial", verbs.RoleAny, verbs.RoleDial, smallSecret, largeSecret, false, "the RoleAny side accepts from a RoleDial peer"},
		{"AnyAny", verbs.RoleAny, verbs.RoleAny, smallSecret, largeSecret, true, "of two RoleAny sides the smaller secret dials"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			defer leakcheck.Check(t)
			p := New()
			pdX, x := newConfiguredQP(t, p, verbs.QueuePairConfig{Role: tc.roleX})
			defer pdX.Close()
			pdY, y := newConfiguredQP(t, p, verbs.QueuePairConfig{Role: tc.roleY})
			defer pdY.Close()
			setSecret(x, tc.secretX)
			setSecret(y, tc.secretY)
			connectPair(t, x, y)
			if dialed(x, y) != tc.wantXDials || dialed(y, x) == tc.wantXDials {
				t.Fatalf("want: %s; x dialed %v, y dialed %v", tc.wantXDialsDesc, dialed(x, y), dialed(y, x))
			}
			exchange(t, x, y)
		})
	}
}

func TestRolesThatCannotMeet(t *testing.T) {
	for _, role := range []verbs.ConnectRole{verbs.RoleDial, verbs.RoleAccept} {
		t.Run(role.String(), func(t *testing.T) {
			defer leakcheck.Check(t)
			p := New()
			pdA, a := newConfiguredQP(t, p, verbs.QueuePairConfig{Role: role})
			defer pdA.Close()
			pdB, b := newConfiguredQP(t, p, verbs.QueuePairConfig{Role: role})
			defer pdB.Close()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			for _, c := range []struct{ q, peer *queuePair }{{a, b}, {b, a}} {
				start := time.Now()
				err := c.q.Connect(ctx, c.peer.LocalInfo())
				if !errors.Is(err, verbs.ErrInvalidInfo) || !strings.Contains(err.Error(), "both sides have role "+role.String()) {
					t.Fatalf("Connect of two %v queue pairs: %v, want ErrInvalidInfo naming the role", role, err)
				}
				if d := time.Since(start); d > 5*time.Second {
					t.Fatalf("Connect took %v to refuse", d)
				}
				if st := c.q.State(); st != verbs.QPReset {
					t.Fatalf("after a refused Connect the queue pair is in %v", st)
				}
			}
		})
	}
}

// TestRoleAcceptNeverDials gives a RoleAccept queue pair a peer info that,
// by secrets alone, would make it dial, with the address of a listener the
// test owns: nothing may connect to that listener. A RoleAny queue pair
// given the same info does dial it, which shows the test would notice.
func TestRoleAcceptNeverDials(t *testing.T) {
	defer leakcheck.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns := make(chan net.Conn, 4)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns <- c
		}
	}()
	defer func() {
		ln.Close()
		<-stopped
		close(conns)
		for c := range conns {
			c.Close()
		}
	}()
	peer := softrc.Info{Role: verbs.RoleAny, Secret: largeSecret, QPID: 5, Addr: ln.Addr().String()}.Encode(infoMagic)

	p := New()
	pdA, a := newConfiguredQP(t, p, verbs.QueuePairConfig{Role: verbs.RoleAccept})
	defer pdA.Close()
	setSecret(a, smallSecret)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	err = a.Connect(ctx, peer)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Connect of a RoleAccept queue pair with no peer dialing: %v, want a deadline error", err)
	}
	select {
	case <-conns:
		t.Fatal("a RoleAccept queue pair dialed the address in its peer's info")
	case <-time.After(200 * time.Millisecond):
	}

	pdN, n := newConfiguredQP(t, p, verbs.QueuePairConfig{})
	defer pdN.Close()
	setSecret(n, smallSecret)
	ctx, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
	n.Connect(ctx, peer) // dials, then waits for a handshake reply in vain
	cancel()
	select {
	case c := <-conns:
		c.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("a RoleAny queue pair with the smaller secret did not dial: the test cannot see dialing")
	}
}

func TestLocalAddress(t *testing.T) {
	defer leakcheck.Check(t)
	p := New()
	pdA, a := newConfiguredQP(t, p, verbs.QueuePairConfig{LocalAddress: netip.MustParseAddr("127.0.0.2"), Role: verbs.RoleAccept})
	defer pdA.Close()
	if !strings.HasPrefix(a.advertise, "127.0.0.2:") {
		t.Fatalf("a queue pair with LocalAddress 127.0.0.2 advertises %q", a.advertise)
	}
	if in, _ := parseInfo(a.LocalInfo()); in.Addr != a.advertise {
		t.Fatalf("its info carries %q", in.Addr)
	}
	pdB, b := newConfiguredQP(t, p, verbs.QueuePairConfig{})
	defer pdB.Close()
	if !strings.HasPrefix(b.advertise, "127.0.0.1:") {
		t.Fatalf("a queue pair with no LocalAddress advertises %q, want 127.0.0.1", b.advertise)
	}
	connectPair(t, a, b)
	a.Mu.Lock()
	local := a.ConnLocked().LocalAddr().String()
	a.Mu.Unlock()
	if local != a.advertise {
		t.Fatalf("the data connection reached %s, want %s", local, a.advertise)
	}
	exchange(t, b, a)

	// One listener per local address: the same address shares it (also
	// written as IPv4-mapped IPv6), another gets its own.
	cq, _ := pdA.NewCompletionQueue(16)
	var advs []string
	for _, addr := range []string{"127.0.0.2", "::ffff:127.0.0.2", "127.0.0.3"} {
		qp, err := pdA.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 1, MaxRecv: 1, LocalAddress: netip.MustParseAddr(addr)})
		if err != nil {
			t.Fatal(err)
		}
		advs = append(advs, qp.(*queuePair).advertise)
	}
	if advs[0] != a.advertise || advs[1] != a.advertise || !strings.HasPrefix(advs[2], "127.0.0.3:") || len(pdA.listeners) != 2 {
		t.Fatalf("advertised %q for 127.0.0.2 twice and 127.0.0.3, %d listeners; want %s twice, 127.0.0.3:port, 2 listeners",
			advs, len(pdA.listeners), a.advertise)
	}
}

func TestLocalAddressKeepsWildcardPort(t *testing.T) {
	defer leakcheck.Check(t)
	free, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	port := free.Addr().(*net.TCPAddr).Port
	free.Close()
	p := New(WithListenAddress("0.0.0.0:" + strconv.Itoa(port)))
	pd, q := newConfiguredQP(t, p, verbs.QueuePairConfig{LocalAddress: netip.MustParseAddr("127.0.0.2")})
	defer pd.Close()
	if want := "127.0.0.2:" + strconv.Itoa(port); q.advertise != want {
		t.Fatalf("advertised %q, want %q: LocalAddress with the wildcard listen address's port", q.advertise, want)
	}
}

func TestLoopbackRefusedToRemotePeer(t *testing.T) {
	defer leakcheck.Check(t)
	remote := netip.MustParseAddr("192.0.2.1") // not loopback, not on this host
	newQP := func(p verbs.Provider, role verbs.ConnectRole) error {
		pd, err := p.Open("")
		if err != nil {
			t.Fatal(err)
		}
		defer pd.Close()
		cq, _ := pd.NewCompletionQueue(16)
		_, err = pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 1, MaxRecv: 1, LocalAddress: remote, Role: role})
		return err
	}
	for _, tc := range []struct {
		name, env, envValue string
		opts                []Option
		from                string
	}{
		{name: "ListenAddress", opts: []Option{WithListenAddress("127.0.0.1:0")}, from: "tcp.WithListenAddress"},
		{name: "AdvertiseAddress", opts: []Option{WithAdvertiseAddress("localhost")}, from: "tcp.WithAdvertiseAddress"},
		{name: "EnvAddr", env: EnvAddr, envValue: "127.0.0.1", from: EnvAddr},
		{name: "EnvIfname", env: EnvSocketIfname, envValue: "=lo", from: EnvSocketIfname},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.env != "" {
				t.Setenv(tc.env, tc.envValue)
			}
			p := New(tc.opts...)
			err := newQP(p, verbs.RoleAny)
			if err == nil {
				t.Fatal("a loopback address was offered over a non-loopback control connection")
			}
			for _, want := range []string{"loopback", "192.0.2.1", tc.from, "tcp.WithListenAddress", "tcp.WithAdvertiseAddress", EnvSocketIfname} {
				if !strings.Contains(err.Error(), want) {
					t.Fatalf("error %q does not mention %q", err, want)
				}
			}
			if err := newQP(p, verbs.RoleAccept); err == nil {
				t.Fatal("a RoleAccept queue pair offered a loopback address to a remote peer")
			}
			// A dialing queue pair offers no address.
			if err := newQP(p, verbs.RoleDial); err != nil {
				t.Fatalf("RoleDial: %v", err)
			}
		})
	}
	// With nothing configured the queue pair listens on its LocalAddress,
	// which here is not one of this host's.
	if err := newQP(New(), verbs.RoleAny); err == nil || !strings.Contains(err.Error(), "192.0.2.1") || !strings.Contains(err.Error(), "LocalAddress") {
		t.Fatalf("listening on a foreign LocalAddress: %v, want an error naming it", err)
	}
}

func TestSocketIfname(t *testing.T) {
	defer leakcheck.Check(t)
	t.Setenv(EnvSocketIfname, "lo")
	if got := EnvSettings()[EnvSocketIfname]; got != "lo" {
		t.Fatalf("EnvSettings()[%s] = %q", EnvSocketIfname, got)
	}
	p := New()
	t.Setenv(EnvSocketIfname, "=nosuchif0") // New read it already
	devs, err := p.Devices()
	if err != nil || len(devs) != 1 || !strings.Contains(devs[0].Description, "interface lo") {
		t.Fatalf("Devices() = %v, %v; want a description naming interface lo", devs, err)
	}
	// The interface comes before LocalAddress.
	pd, q := newConfiguredQP(t, p, verbs.QueuePairConfig{LocalAddress: netip.MustParseAddr("127.0.0.2")})
	defer pd.Close()
	if !strings.HasPrefix(q.advertise, "127.0.0.1:") {
		t.Fatalf("with %s=lo a queue pair advertises %q, want 127.0.0.1:port", EnvSocketIfname, q.advertise)
	}

	// An interface that does not exist: Devices and Open say so, naming
	// the variable.
	bad := New()
	if _, err := bad.Devices(); err == nil || !strings.Contains(err.Error(), EnvSocketIfname) || !strings.Contains(err.Error(), "nosuchif0") || !errors.Is(err, verbs.ErrNoDevice) {
		t.Fatalf("Devices() with an unknown interface: %v", err)
	}
	if _, err := bad.Open(""); err == nil || !strings.Contains(err.Error(), EnvSocketIfname) {
		t.Fatalf("Open with an unknown interface: %v", err)
	}
	// An explicit listen address overrides the variable.
	if pd, err := New(WithListenAddress("127.0.0.1:0")).Open(""); err != nil {
		t.Fatalf("Open with WithListenAddress and an unknown interface: %v", err)
	} else {
		pd.Close()
	}
}

func TestEnvAddr(t *testing.T) {
	defer leakcheck.Check(t)
	t.Setenv(EnvAddr, "127.0.0.2")
	pd, q := newConfiguredQP(t, New(), verbs.QueuePairConfig{LocalAddress: netip.MustParseAddr("127.0.0.3")})
	defer pd.Close()
	if !strings.HasPrefix(q.advertise, "127.0.0.2:") {
		t.Fatalf("with %s=127.0.0.2 a queue pair advertises %q", EnvAddr, q.advertise)
	}
	// The option overrides the variable.
	pd2, q2 := newConfiguredQP(t, New(WithListenAddress("127.0.0.3:0")), verbs.QueuePairConfig{})
	defer pd2.Close()
	if !strings.HasPrefix(q2.advertise, "127.0.0.3:") {
		t.Fatalf("WithListenAddress(127.0.0.3:0) with %s set advertises %q", EnvAddr, q2.advertise)
	}
	t.Setenv(EnvAddr, "[::1")
	if _, err := New().Open(""); err == nil || !strings.Contains(err.Error(), EnvAddr) {
		t.Fatalf("Open with %s=[::1: %v, want an error naming the variable", EnvAddr, err)
	}
}

func TestWithPort(t *testing.T) {
	for in, want := range map[string]string{
		"10.0.0.1": "10.0.0.1:0", "10.0.0.1:7": "10.0.0.1:7", "::1": "[::1]:0", "[::1]": "[::1]:0",
		"[::1]:7": "[::1]:7", "host": "host:0", ":7": ":7",
	} {
		if got, err := withPort(in); err != nil || got != want {
			t.Errorf("withPort(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "[", "[::1", "[]"} {
		if got, err := withPort(in); err == nil {
			t.Errorf("withPort(%q) = %q, want an error", in, got)
		}
	}
}

func TestPickInterface(t *testing.T) {
	a := netip.MustParseAddr
	ifs := []iface{
		{"lo", true, []netip.Addr{a("::1"), a("127.0.0.1")}},
		{"docker0", true, []netip.Addr{a("172.17.0.1")}},
		{"eth0", false, []netip.Addr{a("10.0.0.9")}},
		{"eth1", true, []netip.Addr{a("fe80::1"), a("2001:db8::1")}},
		{"ib0", true, []netip.Addr{a("fe80::2")}},
		{"ib1", true, []netip.Addr{a("2001:db8::5"), a("192.168.1.5")}},
	}
	for _, tc := range []struct{ spec, name, addr string }{
		{"lo", "lo", "127.0.0.1"},
		{"eth", "eth1", "2001:db8::1"}, // eth0 is down; link-local is skipped
		{"=eth1", "eth1", "2001:db8::1"},
		{"ib", "ib1", "192.168.1.5"}, // ib0 has only a link-local address; IPv4 first
		{"^lo,docker", "eth1", "2001:db8::1"},
		{"^=lo", "docker0", "172.17.0.1"},
		{"ib, docker", "docker0", "172.17.0.1"}, // the first matching interface, in system order
		{"^", "lo", "127.0.0.1"},
	} {
		name, addr, err := pickInterface(tc.spec, ifs)
		if err != nil || name != tc.name || addr != a(tc.addr) {
			t.Errorf("pickInterface(%q) = %s, %v, %v; want %s, %s", tc.spec, name, addr, err, tc.name, tc.addr)
		}
	}
	for _, spec := range []string{"=eth", "nosuch", "eth0", "^lo,docker,eth,ib", ","} {
		_, _, err := pickInterface(spec, ifs)
		if err == nil || !strings.Contains(err.Error(), EnvSocketIfname) || !strings.Contains(err.Error(), "eth0 (down)") {
			t.Errorf("pickInterface(%q): %v, want an error naming the variable and the interfaces", spec, err)
		}
	}
}
