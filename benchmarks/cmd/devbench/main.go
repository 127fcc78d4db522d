// Command devbench measures device-tensor transfers on a CUDA GPU beside
// their ceilings, in one run: the driver's pinned and pageable copies
// (through gpudirect), a device-to-device copy, plain Fetches over shm
// and tcp, staged FetchToDevice and SendDevice over shm and tcp (pinned,
// pipelined), and CUDA IPC between two processes (FetchToDevice of a
// tensor another process published on the device, and SendDevice to it).
//
//	devbench [-sizes 64MiB,256MiB] [-reps 5] [-json] [-cuda-lib PATH]
//
// Every transfer's bytes are compared with what was sent once per case.
// Without a CUDA driver it says so and exits 0 (nothing to measure). It
// re-executes itself as the IPC server process.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Result is one measurement: the median GB/s (1e9 bytes per second) of
// reps, and p50 latency.
type Result struct {
	Case    string  `json:"case"`
	Bytes   int     `json:"bytes"`
	GBps    float64 `json:"gb_per_s"`
	P50us   float64 `json:"p50_us"`
	Path    string  `json:"path,omitempty"`
	Ceiling string  `json:"ceiling,omitempty"`
	Of      float64 `json:"of_ceiling,omitempty"`
	Err     string  `json:"error,omitempty"`
}

const roleEnv = "DEVBENCH_ROLE"

func main() {
	if os.Getenv(roleEnv) == "ipc-server" {
		os.Exit(ipcServer())
	}
	sizes := flag.String("sizes", "64MiB,256MiB", "tensor sizes")
	reps := flag.Int("reps", 5, "timed transfers per case and size (after one warm-up)")
	asJSON := flag.Bool("json", false, "print JSON lines instead of a table")
	lib := flag.String("cuda-lib", "", "the CUDA driver library (default libcuda.so.1)")
	flag.Parse()
	var ns []int
	for _, s := range strings.Split(*sizes, ",") {
		n, err := bytesize.Parse(strings.TrimSpace(s))
		if err != nil {
			fmt.Fprintln(os.Stderr, "devbench:", err)
			os.Exit(2)
		}
		ns = append(ns, int(n))
	}
	c, err := loadCUDA(*lib)
	if err != nil {
		fmt.Println("devbench: no CUDA driver, nothing to measure:", err)
		return
	}
	rs, err := run(c, ns, *reps, *lib)
	if err != nil {
		fmt.Fprintln(os.Stderr, "devbench:", err)
	}
	print(rs, *asJSON)
	if err != nil {
		os.Exit(1)
	}
}

func loadCUDA(lib string) (*gpudirect.CUDA, error) {
	if lib != "" {
		return gpudirect.LoadCUDA(gpudirect.WithCUDALibrary(lib))
	}
	return gpudirect.LoadCUDA()
}

func print(rs []Result, asJSON bool) {
	if asJSON {
		enc := json.NewEncoder(os.Stdout)
		for _, r := range rs {
			enc.Encode(r)
		}
		return
	}
	fmt.Println("| case | size | GB/s | p50 µs | path | ceiling | of ceiling |")
	fmt.Println("|---|--:|--:|--:|---|---|--:|")
	for _, r := range rs {
		if r.Err != "" {
			fmt.Printf("| %s | %s | error: %s | | | | |\n", r.Case, bytesize.Format(int64(r.Bytes)), r.Err)
			continue
		}
		of := ""
		if r.Of > 0 {
			of = fmt.Sprintf("%.2f", r.Of)
		}
		fmt.Printf("| %s | %s | %.2f | %.0f | %s | %s | %s |\n", r.Case, bytesize.Format(int64(r.Bytes)), r.GBps, r.P50us, r.Path, r.Ceiling, of)
	}
}

// measure runs f once to warm up and reps times, and reports the median.
func measure(name string, n, reps int, f func() error) Result {
	r := Result{Case: name, Bytes: n}
	if err := f(); err != nil {
		r.Err = err.Error()
		return r
	}
	ds := make([]time.Duration, reps)
	for i := range ds {
		t0 := time.Now()
		if err := f(); err != nil {
			r.Err = err.Error()
			return r
		}
		ds[i] = time.Since(t0)
	}
	slices.Sort(ds)
	med := ds[len(ds)/2]
	r.P50us = float64(med.Nanoseconds()) / 1e3
	r.GBps = float64(n) / med.Seconds() / 1e9
	return r
}

func hostMemory(n int) ([]byte, error) {
	return unix.Mmap(-1, 0, max(n, 4096), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE|unix.MAP_POPULATE)
}

func pattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*13) ^ seed
	}
}

func run(c *gpudirect.CUDA, ns []int, reps int, lib string) ([]Result, error) {
	maxN := slices.Max(ns)
	a, err := c.NewAllocator(0, 3*maxN+8<<20, nil)
	if err != nil {
		return nil, err
	}
	defer a.Close()
	var rs []Result
	for _, n := range ns {
		got := copies(c, a, n, reps)
		got = append(got, transfers(c, a, n, reps, lib)...)
		rs = append(rs, ceilings(got)...)
	}
	return rs, nil
}

// ceilings sets each case's ceiling, measured in the same run: a staged
// transfer's is the slower of the plane's Fetch and the pinned copy
// (issue 26's goal: 0.8× it), CUDA IPC's the device-to-device copy.
func ceilings(rs []Result) []Result {
	gbps := map[string]float64{}
	for _, r := range rs {
		if r.Err == "" {
			gbps[r.Case] = r.GBps
		}
	}
	for i, r := range rs {
		var name string
		var ceil float64
		switch {
		case strings.HasPrefix(r.Case, "fetchtodevice-"):
			plane := strings.TrimPrefix(r.Case, "fetchtodevice-")
			name, ceil = "min(fetch-"+plane+", pinned-htod)", min(gbps["fetch-"+plane], gbps["pinned-htod"])
		case strings.HasPrefix(r.Case, "senddevice-"):
			plane := strings.TrimPrefix(r.Case, "senddevice-")
			name, ceil = "min(fetch-"+plane+", pinned-dtoh)", min(gbps["fetch-"+plane], gbps["pinned-dtoh"])
		case strings.HasPrefix(r.Case, "ipc-"):
			name, ceil = "dtod", gbps["dtod"]
		case strings.HasPrefix(r.Case, "pinned-"), strings.HasPrefix(r.Case, "pageable-"):
			continue
		default:
			continue
		}
		if ceil > 0 && r.Err == "" {
			rs[i].Ceiling, rs[i].Of = name, r.GBps/ceil
		}
	}
	return rs
}

// copies measures the driver's copies through gpudirect: pinned (a stream,
// registered memory) and pageable both ways, and device to device.
func copies(c *gpudirect.CUDA, a *gpudirect.CUDAAllocator, n, reps int) []Result {
	fail := func(name string, err error) []Result { return []Result{{Case: name, Bytes: n, Err: err.Error()}} }
	b0, err := a.Alloc(n)
	if err != nil {
		return fail("copies", err)
	}
	defer b0.Free()
	b1, err := a.Alloc(n)
	if err != nil {
		return fail("copies", err)
	}
	defer b1.Free()
	host, err := hostMemory(n)
	if err != nil {
		return fail("copies", err)
	}
	defer unix.Munmap(host)
	host = host[:n]
	pattern(host, 1)
	var rs []Result
	rs = append(rs, measure("pageable-htod", n, reps, func() error { return b0.CopyFromHost(host, 0) }))
	rs = append(rs, measure("pageable-dtoh", n, reps, func() error { return b0.CopyToHost(host, 0) }))
	ab, ok := b0.(gpudirect.AsyncBuffer)
	if !ok {
		return append(rs, Result{Case: "pinned", Bytes: n, Err: "the driver has no streams: CUDA buffers are not AsyncBuffers"})
	}
	reg := ab.HostRegistrar()
	if err := reg.RegisterHost(host); err != nil {
		return append(rs, Result{Case: "pinned", Bytes: n, Err: err.Error()})
	}
	defer reg.UnregisterHost(host)
	st, err := ab.NewStream()
	if err != nil {
		return append(rs, Result{Case: "pinned", Bytes: n, Err: err.Error()})
	}
	defer st.Close()
	on := func(enqueue func() error) func() error {
		return func() error {
			if err := enqueue(); err != nil {
				return err
			}
			return st.Sync()
		}
	}
	rs = append(rs, measure("pinned-htod", n, reps, on(func() error { return st.CopyFromHost(b0, 0, host) })))
	rs = append(rs, measure("pinned-dtoh", n, reps, on(func() error { return st.CopyToHost(host, b0, 0) })))
	rs = append(rs, measure("dtod", n, reps, on(func() error { return st.CopyDevice(b1, 0, b0, 0, n) })))
	return rs
}

// transfers measures Fetch (the ceiling), staged FetchToDevice and
// SendDevice over shm and tcp in this process, and CUDA IPC with a server
// process of its own.
func transfers(c *gpudirect.CUDA, a *gpudirect.CUDAAllocator, n, reps int, lib string) []Result {
	var rs []Result
	ctx := context.Background()
	want := make([]byte, n)
	pattern(want, 5)
	src, err := a.Alloc(n)
	if err != nil {
		return []Result{{Case: "transfers", Bytes: n, Err: err.Error()}}
	}
	defer src.Free()
	dst, err := a.Alloc(n)
	if err != nil {
		return []Result{{Case: "transfers", Bytes: n, Err: err.Error()}}
	}
	defer dst.Free()
	if err := src.CopyFromHost(want, 0); err != nil {
		return []Result{{Case: "transfers", Bytes: n, Err: err.Error()}}
	}
	check := func() error {
		got := make([]byte, n)
		if err := dst.CopyToHost(got, 0); err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return errors.New("the bytes that arrived differ")
		}
		return nil
	}
	pool := rpc.WithPoolOptions(mempool.WithLimit(int64(4*n + 64<<20)))
	for _, plane := range []string{rpc.TransportSHM, rpc.TransportTCP} {
		srv, addr, stop, err := serve(pool)
		if err != nil {
			rs = append(rs, Result{Case: "server", Err: err.Error()})
			continue
		}
		t, _ := srv.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
		copy(t.Bytes(), want)
		srv.Publish(ctx, "host", t)
		t.Release()
		cl, err := rpc.Dial(ctx, addr, rpc.WithTransportCredentials(insecure.NewCredentials()), rpc.WithTransports(plane), pool)
		if err != nil {
			stop()
			rs = append(rs, Result{Case: "dial " + plane, Err: err.Error()})
			continue
		}
		ceiling := measure("fetch-"+plane, n, reps, func() error {
			t, err := cl.Fetch(ctx, "host")
			if err == nil {
				t.Release()
			}
			return err
		})
		rs = append(rs, ceiling)
		var path string
		fd := measure("fetchtodevice-"+plane, n, reps, func() error {
			_, _, d, err := cl.FetchToDevice(ctx, "host", dst, 0)
			path = d.Path.String()
			return err
		})
		if fd.Err == "" {
			if err := check(); err != nil {
				fd.Err = err.Error()
			}
		}
		fd.Path = path
		sd := measure("senddevice-"+plane, n, reps, func() error {
			d, err := cl.SendDevice(ctx, "sent", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: src})
			path = d.Path.String()
			return err
		})
		sd.Path = path
		rs = append(rs, fd, sd)
		cl.Close()
		stop()
	}
	rs = append(rs, ipc(c, a, n, reps, lib, want)...)
	return rs
}

func serve(opts ...rpc.Option) (*rpc.Server, string, func(), error) {
	var so []rpc.ServerOption
	for _, o := range opts {
		so = append(so, o)
	}
	srv, err := rpc.NewServer(so...)
	if err != nil {
		return nil, "", nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		srv.Close()
		return nil, "", nil, err
	}
	go srv.Serve(lis)
	return srv, lis.Addr().String(), srv.Stop, nil
}

// ipc measures FetchToDevice of a tensor a server process published on
// the device (CUDA IPC), and SendDevice to it.
func ipc(c *gpudirect.CUDA, a *gpudirect.CUDAAllocator, n, reps int, lib string, want []byte) []Result {
	fail := func(err error) []Result { return []Result{{Case: "ipc", Bytes: n, Err: err.Error()}} }
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), roleEnv+"=ipc-server", fmt.Sprintf("DEVBENCH_BYTES=%d", n), "DEVBENCH_CUDA_LIB="+lib)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return fail(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return fail(err)
	}
	if err := cmd.Start(); err != nil {
		return fail(err)
	}
	defer func() {
		in.Close()
		cmd.Wait()
	}()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		return fail(fmt.Errorf("the IPC server process: %w", err))
	}
	ctx := context.Background()
	cl, err := rpc.Dial(ctx, strings.TrimSpace(line), rpc.WithTransportCredentials(insecure.NewCredentials()),
		rpc.WithTransports(rpc.TransportSHM), rpc.WithCUDA(c))
	if err != nil {
		return fail(err)
	}
	defer cl.Close()
	dst, err := a.Alloc(n)
	if err != nil {
		return fail(err)
	}
	defer dst.Free()
	var path string
	fd := measure("ipc-fetchtodevice", n, reps, func() error {
		_, _, d, err := cl.FetchToDevice(ctx, "dev", dst, 0)
		path = d.Path.String()
		return err
	})
	fd.Path = path
	if fd.Err == "" {
		got := make([]byte, n)
		if err := dst.CopyToHost(got, 0); err != nil || !bytes.Equal(got, want) {
			fd.Err = fmt.Sprintf("the bytes that arrived differ (%v)", err)
		}
	}
	sd := measure("ipc-senddevice", n, reps, func() error {
		d, err := cl.SendDevice(ctx, "back", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: dst})
		path = d.Path.String()
		return err
	})
	sd.Path = path
	for _, r := range cl.Rejections() {
		if r.Transport == rpc.TransportCUDAIPC {
			fd.Err = strings.TrimSpace(fd.Err + " (CUDA IPC refused: " + r.Reason + ")")
		}
	}
	return []Result{fd, sd}
}

// ipcServer is the other process of the IPC cases: it publishes
// DEVBENCH_BYTES bytes on the device in place and serves until stdin
// closes.
func ipcServer() int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "devbench ipc server:", err); return 1 }
	var n int
	fmt.Sscan(os.Getenv("DEVBENCH_BYTES"), &n)
	c, err := loadCUDA(os.Getenv("DEVBENCH_CUDA_LIB"))
	if err != nil {
		return fail(err)
	}
	a, err := c.NewAllocator(0, 4*n+8<<20, nil)
	if err != nil {
		return fail(err)
	}
	b, err := a.Alloc(n)
	if err != nil {
		return fail(err)
	}
	host := make([]byte, n)
	pattern(host, 5)
	if err := b.CopyFromHost(host, 0); err != nil {
		return fail(err)
	}
	srv, err := rpc.NewServer(rpc.WithCUDA(c), rpc.WithDeviceAllocator(a), rpc.WithTransports(rpc.TransportSHM, rpc.TransportGRPC),
		rpc.WithPoolOptions(mempool.WithLimit(int64(n+64<<20))))
	if err != nil {
		return fail(err)
	}
	if err := srv.PublishDeviceInPlace(context.Background(), "dev", rpc.DeviceTensor{DType: zerocopy.Uint8, Shape: []int64{int64(n)}, Buffer: b}); err != nil {
		return fail(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	go srv.Serve(lis)
	fmt.Println(lis.Addr())
	bufio.NewReader(os.Stdin).ReadString('\n') // until the parent closes stdin
	srv.Stop()
	b.Free()
	return 0
}
