// Command quickstart shows tensorrpc end to end: a server and a client in
// two processes on this host, the data plane they negotiate, and tensors of
// several sizes sent and fetched over every data plane the host has, with
// the bytes checked and the throughput and copies of each operation shown.
//
//	go run ./examples/quickstart                      # server + client on loopback
//	go run ./examples/quickstart -sizes 4KiB,16MiB -transports shm,tcp
//	go run ./examples/quickstart -serve -listen :7000 # on one host ...
//	go run ./examples/quickstart -addr HOST:7000      # ... and on another
//
// Across hosts the tcp data plane listens on, and advertises, the address
// the client reached the server's gRPC port on, so nothing needs setting;
// -data-addr (or TENSORRPC_TCP_ADDR, TENSORRPC_SOCKET_IFNAME in the
// server's environment) chooses another, e.g. a faster network than the
// one gRPC uses:
//
//	go run ./examples/quickstart -serve -listen :7000 -data-addr 10.1.0.5
//
// Without -addr the program re-executes itself as the server (see
// internal/childproc), reads the address the server prints, and stops
// it at the end. For each data plane it opens a session restricted to that
// plane (rpc.WithTransports), so the table compares planes on the same
// host; a plane that does not connect is listed with the reason.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// serverRole is the role of the re-executed server process.
const serverRole = "quickstart-server"

func main() {
	if childproc.Role() == serverRole {
		os.Exit(serveChild())
	}
	var cfg config
	var sizes, transports string
	var serveOnly bool
	var listen, dataAddr string
	flag.StringVar(&cfg.addr, "addr", "", "use the server at `HOST:PORT` instead of starting one")
	flag.StringVar(&sizes, "sizes", "4KiB,1MiB,64MiB", "tensor sizes, comma-separated (B, KiB, MiB, GiB suffixes)")
	flag.StringVar(&transports, "transports", strings.Join(allPlanes, ","), "data planes to measure, comma-separated")
	flag.IntVar(&cfg.iters, "iters", 0, "timed operations per size and op (default: about 256 MiB worth, 5 to 200)")
	flag.BoolVar(&serveOnly, "serve", false, "only serve, until interrupted, for clients on other hosts")
	flag.StringVar(&listen, "listen", "127.0.0.1:0", "address the server listens on")
	flag.StringVar(&dataAddr, "data-addr", "", "with -serve: the `HOST[:PORT]` the tcp data plane listens on and advertises to clients "+
		"(default: the local address of the gRPC connection each session arrived on, which clients on other hosts can reach; "+
		"the environment variables TENSORRPC_TCP_ADDR=HOST[:PORT] and TENSORRPC_SOCKET_IFNAME=eth0 also set it)")
	flag.Parse()
	if flag.NArg() > 0 {
		usage("unexpected arguments: %s", strings.Join(flag.Args(), " "))
	}
	if dataAddr != "" && !serveOnly {
		usage("-data-addr applies to -serve only (a client uses the address its server advertises)")
	}
	var err error
	if cfg.sizes, err = parseSizes(sizes); err != nil {
		usage("-sizes: %v", err)
	}
	cfg.planes = splitList(transports)
	for _, p := range cfg.planes {
		if !isPlane(p) {
			usage("-transports: unknown data plane %q (want %s)", p, strings.Join(allPlanes, ", "))
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if serveOnly {
		err = serve(listen, dataAddr, os.Stdout, ctx.Done(), announceServing)
	} else {
		_, err = run(ctx, cfg, os.Stdout)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func usage(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "quickstart: "+format+"\n", args...)
	flag.Usage()
	os.Exit(2)
}

// allPlanes are the data planes, in tensorrpc's order of preference.
var allPlanes = []string{rpc.TransportIBV, rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC}

func isPlane(name string) bool { return slices.Contains(allPlanes, name) }

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// announceServing tells the person who started -serve where clients go.
func announceServing(w io.Writer, a net.Addr) {
	host, port, _ := net.SplitHostPort(a.String())
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		host = "THIS-HOST" // listening on every interface
	}
	fmt.Fprintf(w, "quickstart: serving on %s until interrupted (Ctrl-C); on a client host run\n  go run ./examples/quickstart -addr %s\n",
		a, net.JoinHostPort(host, port))
}

// serveChild is the re-executed server: it serves on loopback until the
// parent closes its stdin.
func serveChild() int {
	stopped := make(chan struct{})
	go func() {
		childproc.WaitForStop()
		close(stopped)
	}()
	if err := serve("127.0.0.1:0", "", os.Stdout, stopped, nil); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart server:", err)
		return 1
	}
	return 0
}

// connectTimeout bounds starting the server and opening a session.
const connectTimeout = 30 * time.Second
