package suite

import (
	"bytes"
	"context"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/rpc"
)

// callConfig is a short run of the call cases and the rate case, every
// transfer checked: 4 KiB rides in the control messages, 64 KiB (over the
// eager threshold) crosses the data plane both ways.
func callConfig(t *testing.T) Config {
	t.Helper()
	cfg := QuickConfig()
	var err error
	if cfg.Cases, err = SelectCases("trpc-tcp-call,trpc-shm-call,trpc-grpc-call,grpc-proto-call,call-rate", false); err != nil {
		t.Fatal(err)
	}
	cfg.Payloads = Payloads[:1]
	cfg.Sizes, cfg.Concurrency, cfg.RateCallers = []int{4 << 10, 64 << 10}, []int{1, 2}, []int{1, 3}
	cfg.Serdes, cfg.Codecs = false, false
	cfg.Reps, cfg.MinReps = 2, 2
	cfg.RepTime, cfg.Budget = time.Millisecond, 20*time.Millisecond
	cfg.Verify = VerifyAll
	cfg.Command = "tensorbench calls test"
	return cfg
}

// TestCallCases runs every call case and the rate case with their
// partners alongside, checking every reply's bytes, and then checks that
// the JSON lines render the same tables the run printed.
func TestCallCases(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := callConfig(t)
	var text, jsonl, progress bytes.Buffer
	rep, err := Run(ctx, cfg, &text, &jsonl, &progress)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, progress.String())
	}
	calls := []string{"grpc-proto-call", "trpc-grpc-call", "trpc-tcp-call", "trpc-shm-call"}
	for _, name := range calls {
		for _, size := range cfg.Sizes {
			for _, conc := range cfg.Concurrency {
				m := rep.exact(name, cfg.Payloads[0].Name, int64(size), conc)
				if m == nil {
					t.Errorf("%s %d B c=%d: not measured", name, size, conc)
					continue
				}
				if !m.BothWays || m.GBps <= 0 || m.P50us <= 0 || m.OfCeiling <= 0 {
					t.Errorf("%s %d B c=%d: both ways %v, %v GB/s, p50 %v µs, %v of its ceiling", name, size, conc, m.BothWays, m.GBps, m.P50us, m.OfCeiling)
				}
				// Every timed call of the case, and more (warm-up,
				// calibration, the partners'), had its reply checked.
				if m.Verified <= m.Ops {
					t.Errorf("%s %d B c=%d: %d replies checked, not more than the %d timed calls", name, size, conc, m.Verified, m.Ops)
				}
				if name == "grpc-proto-call" {
					continue
				}
				if m.Baseline != "grpc-proto-call" || m.OfBaseline <= 0 || m.BaselineGBps <= 0 || m.BaselineP50us <= 0 {
					t.Errorf("%s %d B c=%d: baseline %q, %v of it, %v GB/s, p50 %v µs", name, size, conc, m.Baseline, m.OfBaseline, m.BaselineGBps, m.BaselineP50us)
				}
				if plane := strings.TrimSuffix(strings.TrimPrefix(name, "trpc-"), "-call"); m.Transport != plane {
					t.Errorf("%s: transport %q", name, m.Transport)
				}
			}
		}
	}
	if len(rep.Rates) != len(cfg.RateCallers) {
		t.Fatalf("%d rate lines, want %d", len(rep.Rates), len(cfg.RateCallers))
	}
	for i, rt := range rep.Rates {
		if rt.Case != "call-rate" || rt.Callers != cfg.RateCallers[i] || rt.Bytes != 4<<10 || rt.Baseline != "grpc-proto-call" ||
			rt.CallsPerS <= 0 || rt.BaselineCallsPerS <= 0 || rt.Ratio <= 0 || rt.P50us <= 0 || rt.Verified <= rt.Ops {
			t.Errorf("rate line %d: %+v", i, rt)
		}
	}
	for _, want := range []string{
		"## Calls: tensor in, tensor out", "### Calls, GB/s both ways, 2 streams", "| trpc-shm-call | memcpy-echo |",
		"| trpc-tcp-call | grpc-proto-call |", "### Latency of one call, 1 stream", "## Small-message rate: 4 KiB calls per second",
		"| call-rate | tcp | 3 |",
	} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, text.String())
		}
	}
	if strings.Contains(text.String(), "## Transfers") {
		t.Errorf("a run of calls alone prints a one-way transfer section:\n%s", text.String())
	}

	// -render: the JSON lines alone give back the same tables.
	back, err := ReadReport(&jsonl)
	if err != nil {
		t.Fatal(err)
	}
	var rendered bytes.Buffer
	if _, err := Render(back, &rendered, ""); err != nil {
		t.Fatal(err)
	}
	if rendered.String() != text.String() {
		t.Errorf("rendered tables differ from the run's:\n--- run\n%s\n--- rendered\n%s", text.String(), rendered.String())
	}
}

// TestRateNeedsNoSizes checks that the rate case runs at its own size and
// callers whatever -sizes and -concurrency say, and that it alone prints
// only its table.
func TestRateNeedsNoSizes(t *testing.T) {
	cfg := callConfig(t)
	cfg.Cases, _ = SelectCases("call-rate", false)
	cfg.Sizes, cfg.Concurrency, cfg.RateCallers = []int{1 << 20}, []int{5}, []int{2}
	var text bytes.Buffer
	rep, err := Run(context.Background(), cfg, &text, nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Transfers) != 0 || len(rep.Rates) != 1 || rep.Rates[0].Callers != 2 || rep.Rates[0].Bytes != 4<<10 {
		t.Errorf("transfers %+v, rates %+v", rep.Transfers, rep.Rates)
	}
	if !strings.Contains(text.String(), "## Small-message rate") || strings.Contains(text.String(), "## Calls") {
		t.Errorf("output:\n%s", text.String())
	}
}

func TestQuickHasCallAndRate(t *testing.T) {
	cfg := QuickConfig()
	if !slices.ContainsFunc(cfg.Cases, func(c Case) bool { return c.Call && !c.Rate && c.Kind == KindTensorRPC }) {
		t.Error("-quick has no tensorrpc call case")
	}
	if !slices.ContainsFunc(cfg.Cases, func(c Case) bool { return c.Rate }) {
		t.Error("-quick has no rate case")
	}
	if !slices.Equal(cfg.RateCallers, []int{1, 16}) || cfg.RateSize != 4<<10 {
		t.Errorf("rate: %d callers of %d bytes", cfg.RateCallers, cfg.RateSize)
	}
}

func TestDefaultConcurrency(t *testing.T) {
	for cpus, want := range map[int][]int{1: {1, 4}, 2: {1, 4}, 7: {1, 4}, 8: {1, 4, 16, 64}, 64: {1, 4, 16, 64}} {
		if got := DefaultConcurrency(cpus); !slices.Equal(got, want) {
			t.Errorf("DefaultConcurrency(%d) = %v, want %v", cpus, got, want)
		}
	}
	if got := QuickConfig().Concurrency; !slices.Equal(got, []int{1, 4}) {
		t.Errorf("quick concurrency %v, want 1,4 on any machine", got)
	}
}

// TestCallVerifiesReply replaces the echo handler of a call case with one
// that replies with a copy whose middle byte differs: the check of the
// reply fails, on each data plane.
func TestCallVerifiesReply(t *testing.T) {
	src := testSource(64 << 10)
	for _, plane := range []string{"tcp", "shm", "grpc"} {
		env := &caseEnv{payload: Payloads[0], data: src, maxConc: 1}
		sess, err := openTensorRPCCall(plane, false)(context.Background(), env)
		if err != nil {
			t.Fatalf("%s: %v", plane, err)
		}
		cs := sess.(*trpcCallSession)
		cs.server.Handle(callMethod, func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
			in := req.Tensors[0]
			out, err := cs.server.NewTensor(ctx, in.DType(), in.Shape())
			if err != nil {
				return nil, err
			}
			copy(out.Bytes(), in.Bytes())
			out.Bytes()[len(src)/2] ^= 1
			return &rpc.Message{Tensors: []*rpc.Tensor{out}}, nil
		})
		_, err = measure(context.Background(), sess, nil, src, 1, testPlan(VerifyAll))
		if err == nil || !strings.Contains(err.Error(), "differ from the source's") {
			t.Errorf("%s: a corrupted reply gave err = %v", plane, err)
		}
		if err := sess.close(); err != nil {
			t.Errorf("%s: close: %v", plane, err)
		}
	}
}
