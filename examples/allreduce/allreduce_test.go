package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/examples/internal/twohosts"
	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// commandRole is the test binary run as the allreduce command, as a user
// or a launcher starts it.
const commandRole = "allreduce-command"

// stderrToStdout, set in a command's environment, sends its errors to its
// stdout, which the test reads.
const stderrToStdout = "ALLREDUCE_TEST_STDERR_TO_STDOUT"

// TestMain lets the test binary play a rank when allreduce re-executes it,
// and the command when a test starts it as a launched rank.
func TestMain(m *testing.M) {
	switch childproc.Role() {
	case rankRole:
		os.Exit(rankMain(os.Args[1:]))
	case commandRole:
		args := os.Args[1:]
		if len(args) > 0 && strings.HasPrefix(args[0], "-test.") { // childtest.Start's
			args = args[1:]
		}
		if os.Getenv(stderrToStdout) != "" {
			os.Stderr = os.Stdout // the test reads what went wrong
		}
		os.Exit(command(args, os.Getenv, os.Stdout))
	}
	os.Exit(m.Run())
}

func TestRing(t *testing.T) {
	for _, tc := range []struct {
		name     string
		elements int
	}{
		// Chunks of about 40 KB travel inline in control messages; chunks
		// of about 130 KB over the data plane. Neither n divides by 3.
		{"inline", 30001},
		{"dataplane", 100003},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer leakcheck.Check(t)
			cfg := config{Ranks: 3, Elements: tc.elements, Iters: 2, Transports: []string{"ibv", "shm", "tcp", "grpc"}}
			if err := cfg.check(); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
			defer cancel()
			var out bytes.Buffer
			sum, err := run(ctx, &cfg, &out)
			t.Log("\n" + out.String())
			if err != nil {
				t.Fatal(err)
			}
			if !sum.Exact {
				t.Error("result not exact")
			}
			for r, sent := range sum.Sent {
				if d := math.Abs(float64(sent)-sum.Expected) / sum.Expected; d > 0.05 {
					t.Errorf("rank %d sent %d bytes, %.1f%% off 2(p−1)/p·n = %.0f", r, sent, 100*d, sum.Expected)
				}
				if sum.Received[r] != sum.Sent[(r+cfg.Ranks-1)%cfg.Ranks] {
					t.Errorf("rank %d received %d bytes, its left neighbour sent %d", r, sum.Received[r], sum.Sent[(r+cfg.Ranks-1)%cfg.Ranks])
				}
			}
			if sum.AlgBW <= 0 || math.Abs(sum.BusBW/sum.AlgBW-4.0/3) > 1e-9 {
				t.Errorf("algbw %v, busbw %v", sum.AlgBW, sum.BusBW)
			}
		})
	}
}

// TestChunksCoverVector checks that the chunks partition the vector.
func TestChunksCoverVector(t *testing.T) {
	for _, c := range []config{{Ranks: 3, Elements: 10}, {Ranks: 4, Elements: 4}, {Ranks: 7, Elements: 100003}} {
		next := 0
		for k := range c.Ranks {
			lo, hi := chunkRange(&c, k)
			if lo != next || hi < lo {
				t.Fatalf("%+v: chunk %d is [%d, %d), want it to start at %d", c, k, lo, hi, next)
			}
			next = hi
		}
		if next != c.Elements {
			t.Fatalf("%+v: chunks end at %d", c, next)
		}
	}
}

func TestValuesSumExactly(t *testing.T) {
	for i := range 1000 {
		for r := range 8 {
			if v := value(r, i, 3); v != float32(int(v)) || math.Abs(float64(v)) > maxValue {
				t.Fatalf("value(%d, %d) = %v", r, i, v)
			}
		}
	}
}

// launchedRank is one rank of a launched job, started as a process.
type launchedRank struct {
	prefix []string // runs it on another host
	env    []string
	args   []string
}

// runLaunchedJob starts the ranks (with -timeout, -n and -iters added to
// their arguments), waits for every one to exit and returns rank 0's
// output. It fails t when a rank fails.
func runLaunchedJob(t *testing.T, ranks []launchedRank) string {
	t.Helper()
	var procs []*childproc.Process
	for _, r := range ranks {
		args := append([]string{"-timeout", "40s", "-n", "100003", "-iters", "2"}, r.args...)
		procs = append(procs, childtest.Start(t, commandRole, childproc.Options{Prefix: r.prefix, Env: r.env, Args: args}))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := childtest.Job(ctx, t, procs)
	if !strings.Contains(out, "result exact") {
		t.Error("rank 0 did not say the result is exact")
	}
	return out
}

// freePort returns a TCP port nothing listens on now.
func freePort(t *testing.T) string {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return strconv.Itoa(lis.Addr().(*net.TCPAddr).Port)
}

// TestLaunched starts three ranks as separate processes, as torchrun
// would: each finds its rank and rank 0 from RANK, WORLD_SIZE, MASTER_ADDR
// and MASTER_PORT, and rank 0 prints the summary. Rank 2 is given flags
// instead, which win over a contradicting environment.
func TestLaunched(t *testing.T) {
	port := freePort(t)
	env := func(rank string) []string {
		return []string{"RANK=" + rank, "WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port}
	}
	out := runLaunchedJob(t, []launchedRank{
		{env: env("0")},
		{env: env("1")},
		{env: []string{"RANK=7", "WORLD_SIZE=9", "MASTER_ADDR=192.0.2.1", "MASTER_PORT=1"},
			args: []string{"-rank", "2", "-world", "3", "-master", "127.0.0.1:" + port}},
	})
	if !strings.Contains(out, "allreduce: 3 processes") {
		t.Error("rank 0 did not print the header")
	}
}

// TestLaunchedTwoHosts runs the ranks on two hosts (network namespaces
// joined by a veth pair): ranks 0 and 2 on the first, rank 1 on the
// second, each started by `ip netns exec`, as ssh would start it on another
// machine. The ring crosses the link twice, over tcp.
func TestLaunchedTwoHosts(t *testing.T) {
	h := twohosts.New(t)
	env := func(rank int) []string {
		return []string{fmt.Sprintf("RANK=%d", rank), "WORLD_SIZE=3", "MASTER_ADDR=" + h.IP[0], "MASTER_PORT=29500"}
	}
	out := runLaunchedJob(t, []launchedRank{
		{prefix: h.Prefix(0), env: env(0)},
		{prefix: h.Prefix(1), env: env(1)},
		{prefix: h.Prefix(0), env: env(2)},
	})
	if !strings.Contains(out, "data plane") || !strings.Contains(out, "tcp") {
		t.Error("the ring did not cross hosts over tcp")
	}
}

// TestLaunchedRankDies: a rank killed while the others wait for it at a
// barrier (here rank 0 waits for rank 1, which never starts) fails the job
// when rank 0 sees its session with the store end, not at -timeout.
func TestLaunchedRankDies(t *testing.T) {
	port := freePort(t)
	master := "127.0.0.1:" + port
	env := func(rank string) []string {
		return []string{"RANK=" + rank, "WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port, stderrToStdout + "=1"}
	}
	args := []string{"-timeout", "5m", "-n", "100003", "-iters", "2"}
	r0 := childtest.Start(t, commandRole, childproc.Options{Env: env("0"), Args: args})
	r2 := childtest.Start(t, commandRole, childproc.Options{Env: env("2"), Args: args})

	// Rank 2 has put its address once its session with the store is up.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var c *rpc.Client
	for c == nil {
		var err error
		if c, err = rpc.Dial(ctx, master, rpc.WithTransportCredentials(insecure.NewCredentials()), rpc.WithName("test")); err != nil {
			if ctx.Err() != nil {
				t.Fatal(err)
			}
			time.Sleep(100 * time.Millisecond) // rank 0 is not listening yet
		}
	}
	addr, err := c.Fetch(ctx, addrKey(2), rpc.WaitForKey())
	if err != nil {
		t.Fatal(err)
	}
	addr.Release()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	r2.Kill()

	var out strings.Builder
	for {
		l, err := r0.ReadLine(ctx)
		if errors.Is(err, childproc.ErrExited) {
			break
		}
		if err != nil {
			t.Fatalf("rank 0 went on after rank 2 was killed: %v; it printed:\n%s", err, out.String())
		}
		out.WriteString(l + "\n")
	}
	if err := r0.Wait(); err == nil {
		t.Fatalf("rank 0 succeeded; it printed:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "rank 2 left") {
		t.Fatalf("rank 0 failed without naming rank 2; it printed:\n%s", out.String())
	}
	t.Log("rank 0 printed:\n" + out.String())
}

func TestResolveLaunch(t *testing.T) {
	torchrun := map[string]string{"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
	for _, tc := range []struct {
		name string
		set  map[string]string
		env  map[string]string
		want *launch // nil: not launched, or an error when err
		err  bool
	}{
		{name: "parent mode"},
		{name: "env", env: torchrun, want: &launch{rank: 1, world: 4, master: "10.0.0.1:29500"}},
		{name: "flags win", env: torchrun, set: map[string]string{"rank": "2", "master": "h:1", "listen": "10.0.0.3:0"},
			want: &launch{rank: 2, world: 4, master: "h:1", listen: "10.0.0.3:0"}},
		{name: "ipv6", env: map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "fd00::1", "MASTER_PORT": "7"},
			want: &launch{rank: 0, world: 2, master: "[fd00::1]:7"}},
		{name: "torchrun's store", env: map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, err: true},
		{name: "torchrun's store, -master", set: map[string]string{"master": "h:2"},
			env:  map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"},
			want: &launch{rank: 0, world: 2, master: "h:2"}},
		{name: "no world", set: map[string]string{"rank": "0", "master": "h:1"}, err: true},
		{name: "no master", env: map[string]string{"RANK": "0", "WORLD_SIZE": "2"}, err: true},
		{name: "rank outside", env: map[string]string{"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, err: true},
		{name: "bad master", set: map[string]string{"rank": "0", "world": "2", "master": "h"}, err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.set == nil {
				tc.set = map[string]string{}
			}
			got, err := resolveLaunch(tc.set, func(k string) string { return tc.env[k] })
			switch {
			case tc.err && err == nil:
				t.Fatalf("got %+v, want an error", got)
			case !tc.err && err != nil:
				t.Fatal(err)
			case !tc.err && (got == nil) != (tc.want == nil), got != nil && *got != *tc.want:
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}
