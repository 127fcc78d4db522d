package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/benchmarks/internal/suite"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// The slow-link section: tcp Fetches over a veth pair into a network
// namespace, shaped with tbf to a rate, with each payload and compression
// mode; and on unshaped loopback (tcp and shm) auto against off. It needs
// root and iproute2 (ip, tc); without them it says so and measures
// nothing.

// slowLinkConfig is what the section measures.
type slowLinkConfig struct {
	rates    []string // tc rates, e.g. 1gbit
	size     int      // bytes of each Fetch over the shaped link
	reps     int      // timed Fetches per measurement (after one untimed)
	payloads []suite.Payload
	modes    []string
}

// slowLinkResult is one JSON line of the section.
type slowLinkResult struct {
	Kind      string  `json:"kind"` // "slowlink"
	Link      string  `json:"link"` // the tc rate, or "loopback"
	Transport string  `json:"transport"`
	Payload   string  `json:"payload"`
	Mode      string  `json:"mode"`
	Bytes     int     `json:"bytes"`
	Reps      int     `json:"reps"`
	MedianMs  float64 `json:"median_ms"`
	GBps      float64 `json:"gb_per_s"`
	// VsOff is this mode's median time over off's, measured in the same
	// run (for loopback, in reps taking turns with off's): < 1 is faster.
	VsOff float64 `json:"time_vs_off"`
	// Compressed and WireBytes: what the client's Stats said of the
	// measurement's Fetches, the untimed first one included (compressed
	// transfers), and the bytes that crossed the wire for the last one
	// (CallInfo; 0 where the session does not compress).
	Compressed int64 `json:"compressed"`
	WireBytes  int64 `json:"wire_bytes"`
}

// slowLinkServe is the child: a Server listening on addr (inside the
// namespace), printing its address, until stdin closes.
func slowLinkServe(addr string) error {
	srv, err := rpc.NewServer(rpc.WithPoolOptions(mempool.WithLimit(2 << 30)))
	if err != nil {
		return err
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	fmt.Println(lis.Addr().String())
	go srv.Serve(lis)
	io.Copy(io.Discard, os.Stdin)
	srv.Stop()
	return nil
}

// slowLinkNeeds says why the section cannot run here, or "".
func slowLinkNeeds() string {
	if os.Geteuid() != 0 {
		return "not root (network namespaces and tc need it)"
	}
	for _, tool := range []string{"ip", "tc"} {
		if _, err := exec.LookPath(tool); err != nil {
			return tool + " not found (Debian: apt-get install iproute2)"
		}
	}
	return ""
}

func sh(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

// shapedLink is a namespace joined by a veth pair whose two ends tbf
// shapes to one rate.
type shapedLink struct {
	ns, hostIf, nsIf, hostIP, nsIP string
}

func newShapedLink() (*shapedLink, error) {
	id := os.Getpid() % 200
	l := &shapedLink{ns: fmt.Sprintf("tbslow%d", id), hostIf: fmt.Sprintf("tbsh%d", id), nsIf: fmt.Sprintf("tbsn%d", id),
		hostIP: fmt.Sprintf("10.212.%d.1", id), nsIP: fmt.Sprintf("10.212.%d.2", id)}
	if err := sh("ip", "netns", "add", l.ns); err != nil {
		return nil, err
	}
	for _, a := range [][]string{
		{"ip", "link", "add", l.hostIf, "type", "veth", "peer", "name", l.nsIf},
		{"ip", "link", "set", l.nsIf, "netns", l.ns},
		{"ip", "addr", "add", l.hostIP + "/24", "dev", l.hostIf},
		{"ip", "link", "set", l.hostIf, "up"},
		{"ip", "netns", "exec", l.ns, "ip", "addr", "add", l.nsIP + "/24", "dev", l.nsIf},
		{"ip", "netns", "exec", l.ns, "ip", "link", "set", l.nsIf, "up"},
		{"ip", "netns", "exec", l.ns, "ip", "link", "set", "lo", "up"},
	} {
		if err := sh(a...); err != nil {
			l.close()
			return nil, err
		}
	}
	return l, nil
}

// shape sets both ends to rate (tc's syntax, e.g. 1gbit), with a burst of
// 2 ms of it, at least 256 KiB (the 1gbit link has 256kb; tbf
// needs a burst of at least the rate over the kernel's timer frequency to
// reach the rate).
func (l *shapedLink) shape(rate string) error {
	bps, err := parseRate(rate)
	if err != nil {
		return err
	}
	burst := fmt.Sprintf("%dkb", max(256, bps/8/500/1024))
	for _, pre := range [][]string{{}, {"ip", "netns", "exec", l.ns}} {
		dev := l.hostIf
		if len(pre) > 0 {
			dev = l.nsIf
		}
		if err := sh(append(pre, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")...); err != nil {
			return err
		}
	}
	return nil
}

func (l *shapedLink) close() {
	sh("ip", "link", "del", l.hostIf)
	sh("ip", "netns", "del", l.ns)
}

// parseRate reads a tc rate in bits a second: 1gbit, 100mbit, 500kbit.
func parseRate(s string) (int, error) {
	var n int
	var unit string
	if _, err := fmt.Sscanf(s, "%d%s", &n, &unit); err != nil {
		return 0, fmt.Errorf("rate %q: %v", s, err)
	}
	switch unit {
	case "gbit":
		return n * 1e9, nil
	case "mbit":
		return n * 1e6, nil
	case "kbit":
		return n * 1e3, nil
	}
	return 0, fmt.Errorf("rate %q: want a number and gbit, mbit or kbit", s)
}

// runSlowLink runs the section, printing a table to out and JSON lines to
// jsonl (when not nil).
func runSlowLink(ctx context.Context, cfg slowLinkConfig, out, jsonl, progress io.Writer) error {
	var results []slowLinkResult
	emit := func(r slowLinkResult) {
		results = append(results, r)
		if jsonl != nil {
			b, _ := json.Marshal(r)
			fmt.Fprintf(jsonl, "%s\n", b)
		}
	}
	fmt.Fprintf(progress, "slow-link: loopback, tcp and shm, auto against off\n")
	if err := loopbackAutoCost(ctx, cfg, emit); err != nil {
		return fmt.Errorf("slow-link loopback: %w", err)
	}
	if why := slowLinkNeeds(); why != "" {
		fmt.Fprintf(out, "\nslow-link: the shaped links are skipped: %s\n", why)
	} else if err := shapedRuns(ctx, cfg, emit, progress); err != nil {
		return fmt.Errorf("slow-link: %w", err)
	}
	fmt.Fprintf(out, "\n## Slow links: tcp Fetch with compression (median of %d, time relative to off in the same run)\n\n", cfg.reps)
	fmt.Fprintf(out, "| link | plane | payload | bytes | mode | median ms | GB/s | time vs off | compressed | wire bytes |\n|---|---|---|--:|---|--:|--:|--:|--:|--:|\n")
	for _, r := range results {
		fmt.Fprintf(out, "| %s | %s | %s | %d | %s | %.3f | %.3f | %.2f | %d | %d |\n", r.Link, r.Transport, r.Payload, r.Bytes, r.Mode, r.MedianMs, r.GBps, r.VsOff, r.Compressed, r.WireBytes)
	}
	return nil
}

// fetcher is one Client of a mode, with the CallInfo of its last Fetch.
type fetcher struct {
	mode string
	c    *rpc.Client
	wire int64
}

func dialMode(ctx context.Context, addr, mode, plane string) (*fetcher, error) {
	f := &fetcher{mode: mode}
	look := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
		err := next(ctx)
		if info.Op == rpc.OpFetch {
			f.wire = info.WireBytes
		}
		return err
	}
	c, err := rpc.Dial(ctx, addr, rpc.WithTransportCredentials(insecure.NewCredentials()), rpc.WithTransports(plane),
		rpc.WithCompression(mode), rpc.WithInlineInterceptors(look), rpc.WithPoolOptions(mempool.WithLimit(2<<30)))
	if err != nil {
		return nil, err
	}
	if c.Transport() != plane {
		c.Close()
		return nil, fmt.Errorf("negotiated %s, not %s", c.Transport(), plane)
	}
	f.c = c
	return f, nil
}

// fetchTimes fetches key reps times (after one untimed) and returns each
// time.
func (f *fetcher) fetchTimes(ctx context.Context, key string, reps int) ([]time.Duration, error) {
	var ts []time.Duration
	for i := range reps + 1 {
		t0 := time.Now()
		t, err := f.c.Fetch(ctx, key)
		if err != nil {
			return nil, err
		}
		el := time.Since(t0)
		t.Release()
		if i > 0 {
			ts = append(ts, el)
		}
	}
	return ts, nil
}

func median(ts []time.Duration) time.Duration {
	s := slices.Clone(ts)
	slices.Sort(s)
	return s[len(s)/2]
}

// publish sends a tensor of n bytes of payload p to the server as key.
func publish(ctx context.Context, c *rpc.Client, key string, p suite.Payload, n int) error {
	t, err := c.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
	if err != nil {
		return err
	}
	defer t.Release()
	p.Fill(t.Bytes(), uint64(n))
	return c.Send(rpc.UseCompression(ctx, rpc.CompressionAuto), key, t)
}

// shapedRuns measures every rate, payload and mode over a shaped link.
func shapedRuns(ctx context.Context, cfg slowLinkConfig, emit func(slowLinkResult), progress io.Writer) error {
	link, err := newShapedLink()
	if err != nil {
		return err
	}
	defer link.close()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	child := exec.Command("ip", "netns", "exec", link.ns, self, "-slow-link-serve", link.nsIP+":0")
	stdin, _ := child.StdinPipe()
	stdout, _ := child.StdoutPipe()
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		return err
	}
	defer func() { stdin.Close(); child.Wait() }()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		return fmt.Errorf("the server in the namespace: %w", err)
	}
	addr := strings.TrimSpace(line)
	for _, rate := range cfg.rates {
		if err := link.shape(rate); err != nil {
			return err
		}
		fs := map[string]*fetcher{}
		for _, m := range cfg.modes {
			if fs[m], err = dialMode(ctx, addr, m, rpc.TransportTCP); err != nil {
				return err
			}
			defer fs[m].c.Close()
		}
		for _, p := range cfg.payloads {
			key := fmt.Sprintf("%s-%s", rate, p.Name)
			if err := publish(ctx, fs[cfg.modes[0]].c, key, p, cfg.size); err != nil {
				return err
			}
			var off time.Duration
			for _, m := range cfg.modes {
				f := fs[m]
				before := f.c.Stats().CompressedTransfers
				ts, err := f.fetchTimes(ctx, key, cfg.reps)
				if err != nil {
					return fmt.Errorf("%s %s %s: %w", rate, p.Name, m, err)
				}
				med := median(ts)
				if m == rpc.CompressionOff {
					off = med
				}
				r := slowLinkResult{Kind: "slowlink", Link: rate, Transport: rpc.TransportTCP, Payload: p.Name, Mode: m, Bytes: cfg.size, Reps: cfg.reps,
					MedianMs: float64(med.Microseconds()) / 1e3, GBps: float64(cfg.size) / med.Seconds() / 1e9,
					Compressed: f.c.Stats().CompressedTransfers - before, WireBytes: f.wire}
				if off > 0 {
					r.VsOff = float64(med) / float64(off)
				}
				fmt.Fprintf(progress, "slow-link: %s %s %s: %.1f ms (%.2f of off), %d compressed\n", rate, p.Name, m, r.MedianMs, r.VsOff, r.Compressed)
				emit(r)
			}
		}
	}
	return nil
}

// loopbackAutoCost measures auto against off on unshaped loopback, tcp
// and shm, at 4 KiB and the section's size, the two modes' Fetches taking
// turns so that a noisy machine slows both alike.
func loopbackAutoCost(ctx context.Context, cfg slowLinkConfig, emit func(slowLinkResult)) error {
	srv, err := rpc.NewServer(rpc.WithPoolOptions(mempool.WithLimit(2 << 30)))
	if err != nil {
		return err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go srv.Serve(lis)
	defer srv.Stop()
	p, _ := suite.PayloadByName("sparse-f32") // the most compressible: auto's hardest case
	for _, plane := range []string{rpc.TransportTCP, rpc.TransportSHM} {
		off, err := dialMode(ctx, lis.Addr().String(), rpc.CompressionOff, plane)
		if err != nil {
			if errors.Is(err, context.Canceled) {
				return err
			}
			continue // shm may be refused here; tcp always works
		}
		auto, err := dialMode(ctx, lis.Addr().String(), rpc.CompressionAuto, plane)
		if err != nil {
			off.c.Close()
			return err
		}
		for _, n := range []int{4 << 10, cfg.size} {
			key := fmt.Sprintf("loopback-%s-%d", plane, n)
			if err := publish(ctx, off.c, key, p, n); err != nil {
				return err
			}
			reps := max(cfg.reps, 9)
			if n <= 64<<10 {
				reps = 2000
			}
			var toff, tauto []time.Duration
			before := auto.c.Stats().CompressedTransfers
			for range 3 { // turns
				a, err := off.fetchTimes(ctx, key, reps/3)
				if err != nil {
					return err
				}
				b, err := auto.fetchTimes(ctx, key, reps/3)
				if err != nil {
					return err
				}
				toff, tauto = append(toff, a...), append(tauto, b...)
			}
			mo, ma := median(toff), median(tauto)
			for _, r := range []struct {
				mode string
				med  time.Duration
				comp int64
			}{{rpc.CompressionOff, mo, 0}, {rpc.CompressionAuto, ma, auto.c.Stats().CompressedTransfers - before}} {
				emit(slowLinkResult{Kind: "slowlink", Link: "loopback", Transport: plane, Payload: p.Name, Mode: r.mode, Bytes: n, Reps: len(toff),
					MedianMs: float64(r.med.Nanoseconds()) / 1e6, GBps: float64(n) / r.med.Seconds() / 1e9, VsOff: float64(r.med) / float64(mo), Compressed: r.comp})
			}
		}
		off.c.Close()
		auto.c.Close()
	}
	return nil
}
