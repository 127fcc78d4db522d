package rpc_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/internal/testenv"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// twoHosts is a second "host": a network namespace joined to this one by a
// veth pair, so the two share no loopback, as two machines.
type twoHosts struct {
	ns     string // the namespace
	hostIf string // this side's end of the veth pair
	nsIf   string // the namespace's end
	hostIP string // this side of the veth
	nsIP   string // the namespace's side
	nsIP2  string // a second address of the namespace's side, not routed from here
}

// newTwoHosts makes the namespace and removes it when the test ends. It
// skips, saying why, where namespaces cannot be made (not root, no
// iproute2, no permission in a container); under CI=true it fails instead,
// so that a CI image without them cannot pass by skipping.
func newTwoHosts(t *testing.T) *twoHosts {
	t.Helper()
	testenv.NeedNetns(t)
	id := (os.Getpid()*7 + int(time.Now().UnixNano()%1000)) % 250
	h := &twoHosts{
		ns:     fmt.Sprintf("trpcrpc%d", id),
		hostIP: fmt.Sprintf("10.202.%d.1", id),
		nsIP:   fmt.Sprintf("10.202.%d.2", id),
		nsIP2:  fmt.Sprintf("10.203.%d.2", id),
	}
	hostIf, nsIf := fmt.Sprintf("trpch%d", id), fmt.Sprintf("trpcn%d", id)
	h.hostIf, h.nsIf = hostIf, nsIf
	ip := func(args ...string) error {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	if err := ip("netns", "add", h.ns); err != nil {
		testenv.Need(t, "cannot create a network namespace here: %v", err)
	}
	t.Cleanup(func() { ip("link", "del", hostIf); ip("netns", "del", h.ns) })
	for _, args := range [][]string{
		{"link", "add", hostIf, "type", "veth", "peer", "name", nsIf},
		{"link", "set", nsIf, "netns", h.ns},
		{"addr", "add", h.hostIP + "/24", "dev", hostIf},
		{"link", "set", hostIf, "up"},
		{"netns", "exec", h.ns, "ip", "addr", "add", h.nsIP + "/24", "dev", nsIf},
		{"netns", "exec", h.ns, "ip", "addr", "add", h.nsIP2 + "/32", "dev", nsIf},
		{"netns", "exec", h.ns, "ip", "link", "set", nsIf, "up"},
		{"netns", "exec", h.ns, "ip", "link", "set", "lo", "up"},
	} {
		if err := ip(args...); err != nil {
			testenv.Need(t, "cannot set up a veth pair: %v", err)
		}
	}
	return h
}

// serverIn starts a child server process inside the namespace, listening
// on the namespace's address, with default options plus env; it returns
// the child and its gRPC address.
func (h *twoHosts) serverIn(t *testing.T, size int, env ...string) (*childproc.Process, string) {
	t.Helper()
	env = append(env, "TENSORRPC_TEST_LISTEN="+h.nsIP+":0")
	ch := startChildCmd(t, []string{"ip", "netns", "exec", h.ns}, "server", "", size, env...)
	return ch, childtest.Line(t, ch)
}

// TestTwoHostsDefaultOptions: with default options on both sides, a
// client on one "host" and a server on the other negotiate tcp (the server
// listens on and advertises the address the session arrived on) and move
// a 64 MiB tensor bit-exact both ways.
func TestTwoHostsDefaultOptions(t *testing.T) {
	const size = 64 << 20
	h := newTwoHosts(t)
	t.Cleanup(func() { leakcheck.Check(t) })
	ch, addr := h.serverIn(t, size)
	ctx := ctxT(t)
	c, err := rpc.Dial(ctx, addr, testPool(), insecureCreds())
	if err != nil {
		t.Fatal(err)
	}
	defer closeClient(t, c)
	if c.Transport() != rpc.TransportTCP {
		t.Fatalf("negotiated %s across hosts, want tcp: %v", c.Transport(), c.Rejections())
	}
	t.Logf("rejected across hosts, as expected: %v", c.Rejections())

	want := make([]byte, size)
	fill(want, 7) // the child's published "big"
	got, err := c.Fetch(ctx, "big")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), want) {
		t.Fatal("fetched 64 MiB differ")
	}
	got.Release()

	up, err := c.NewTensor(ctx, zerocopy.Uint8, []int64{size})
	if err != nil {
		t.Fatal(err)
	}
	fill(up.Bytes(), 42)
	if err := c.Send(ctx, "up", up); err != nil {
		t.Fatal(err)
	}
	back, err := c.Fetch(ctx, "up")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back.Bytes(), up.Bytes()) {
		t.Fatal("64 MiB sent and fetched back differ")
	}
	back.Release()
	up.Release()
	if st := c.Stats(); st.DataPlaneBytes < 3*size {
		t.Fatalf("only %d bytes moved over the data plane", st.DataPlaneBytes)
	}
	ch.Kill()
}

// TestTwoHostsUnreachableDataPlane blackholes the server's data address
// (the server advertises a second address that this host routes to a
// blackhole): the Dial falls back to grpc at once, without waiting for a
// timeout, and the rejection names the cause and the fix.
func TestTwoHostsUnreachableDataPlane(t *testing.T) {
	h := newTwoHosts(t)
	t.Cleanup(func() { leakcheck.Check(t) })
	out, err := exec.Command("ip", "route", "add", "blackhole", h.nsIP2+"/32").CombinedOutput()
	if err != nil {
		t.Skipf("cannot add a blackhole route: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "route", "del", "blackhole", h.nsIP2+"/32").Run() })
	ch, addr := h.serverIn(t, 1<<20, "TENSORRPC_TEST_DATA_ADDR="+h.nsIP2)
	ctx := ctxT(t)
	start := time.Now()
	c, err := rpc.Dial(ctx, addr, testPool(), insecureCreds(), rpc.WithConnectTimeout(time.Minute))
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	defer closeClient(t, c)
	t.Logf("Dial with the data address blackholed took %v and chose %s: %v", took, c.Transport(), c.Rejections())
	if c.Transport() != rpc.TransportGRPC {
		t.Fatalf("negotiated %s, want the grpc fallback", c.Transport())
	}
	if took > 30*time.Second { // the one-minute connect timeout, not a slow machine
		t.Fatalf("Dial took %v: it waited for the connect timeout", took)
	}
	found := false
	for _, r := range c.Rejections() {
		if r.Transport == rpc.TransportTCP && strings.Contains(r.Reason, h.nsIP2) && r.Fix != "" {
			found = true
		}
	}
	if !found {
		t.Fatalf("no tcp rejection naming %s and a fix: %v", h.nsIP2, c.Rejections())
	}
	got, err := c.Fetch(ctx, "big")
	if err != nil {
		t.Fatal(err)
	}
	got.Release()
	ch.Kill()
}

// shape makes the link between the hosts rate (tc's syntax) both ways,
// with tbf (netem is not there on every machine).
func (h *twoHosts) shape(t *testing.T, rate string) {
	t.Helper()
	for _, args := range [][]string{
		{"tc", "qdisc", "add", "dev", h.hostIf, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"},
		{"ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", h.nsIf, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"},
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			testenv.Need(t, "cannot shape the link with tc: %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
}

// TestTwoHostsSlowLinkCompression: over a link shaped to 200 Mb/s (slower
// than any codec, even under the race detector), with default options on
// both sides (compression auto), sparse tensors cross compressed both
// ways (the server reads a Send, the client a Fetch) and random ones do
// not; every byte arrives exact.
//
// On the gRPC fallback (the client allows no data plane) the same holds of
// the second Fetch: the first measures the stream, as it is.
func TestTwoHostsSlowLinkCompression(t *testing.T) {
	h := newTwoHosts(t)
	h.shape(t, "200mbit")
	t.Cleanup(func() { leakcheck.Check(t) })
	ch, addr := h.serverIn(t, 4096)
	for _, plane := range []string{rpc.TransportTCP, rpc.TransportGRPC} {
		t.Run(plane, func(t *testing.T) { slowLinkCompression(t, addr, plane) })
	}
	ch.Kill()
}

func slowLinkCompression(t *testing.T, addr, plane string) {
	const size = 8 << 20
	ctx := ctxT(t)
	var last rpc.CallInfo
	look := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
		err := next(ctx)
		last = *info
		return err
	}
	c, err := rpc.Dial(ctx, addr, testPool(), insecureCreds(), rpc.WithInlineInterceptors(look), rpc.WithTransports(plane))
	if err != nil {
		t.Fatal(err)
	}
	defer closeClient(t, c)
	if c.Transport() != plane {
		t.Fatalf("negotiated %s across hosts, want %s: %v", c.Transport(), plane, c.Rejections())
	}
	for _, kind := range []string{"sparse-f32", "random"} {
		x := payloadTensor(t, c, kind, size, 11)
		if err := c.Send(ctx, kind, x); err != nil {
			t.Fatal(err)
		}
		before := c.Stats().CompressedTransfers
		// The first may probe the link; the second, after one that came
		// compressed on the probe's word, crosses as it is to measure it.
		// A compressed one that came slower than the link moves bytes as
		// they are (a loaded machine compressing under the race
		// detector) makes the next go as it is, to check, and then as
		// many as auto's backoff (1, then 2, ...): sparse tensors are
		// fetched, from the third on, until one comes compressed again,
		// at most maxFetches (three losses' checks and backoffs).
		const fetches, maxFetches = 3, 9
		var modes []string
		smallest := int64(size)
		for i := 0; i < fetches || kind == "sparse-f32" && i < maxFetches && last.Compression == rpc.CompressionOff; i++ {
			got, err := c.Fetch(ctx, kind)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), x.Bytes()) {
				t.Fatalf("%s: fetched bytes differ", kind)
			}
			got.Release()
			t.Logf("%s Fetch %d: compression %q, %d bytes on the wire, goodput %.0f Mb/s, sampled ratio %.2f", kind, i, last.Compression, last.WireBytes, last.Goodput*8/1e6, last.SampleRatio)
			modes = append(modes, last.Compression)
			// A Fetch is several Reads, each deciding on its own: on the
			// first, the probe's MiB and, on a loaded machine, Reads
			// whose sample compressed too slowly cross as they are. So
			// every compressed one shrinks, and one at least by half.
			if kind == "sparse-f32" && last.Compression != rpc.CompressionOff {
				if last.WireBytes >= size {
					t.Errorf("sparse: Fetch %d compressed into %d bytes of %d", i, last.WireBytes, size)
				}
				smallest = min(smallest, last.WireBytes)
			}
		}
		if kind == "sparse-f32" && smallest > size/2 {
			t.Errorf("sparse: no Fetch compressed into half its %d bytes or less (smallest %d; %q)", size, smallest, modes)
		}
		n := c.Stats().CompressedTransfers - before
		lastOff := last.Compression == rpc.CompressionOff
		switch {
		case kind == "sparse-f32" && (n == 0 || lastOff):
			t.Errorf("sparse: %d of %d Fetches compressed (%q); want the last compressed", n, len(modes), modes)
		case kind == "random" && (n != 0 || last.Compression != rpc.CompressionOff):
			t.Errorf("random: %d Fetches compressed (the last %q); want none", n, last.Compression)
		case plane == rpc.TransportTCP && kind == "random" && (last.SampleRatio < 0.99 || last.SampleRatio > 1.05):
			t.Errorf("random: the sample's ratio %.2f, want about 1 (sampled, incompressible)", last.SampleRatio)
		case plane == rpc.TransportTCP && kind == "sparse-f32" && last.SampleRatio < 3:
			t.Errorf("sparse: the sample's ratio %.2f, want 3 or more", last.SampleRatio)
		}
		x.Release()
	}
}
