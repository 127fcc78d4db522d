package suite

import (
	"bytes"
	"strings"
	"testing"
)

// TestLatencyAgainstPingPong: the latency table sets each case's 4 KiB
// p50 beside its ping-pong's (the unix socket for cases through memory,
// the TCP socket for cases over TCP) and beside grpc-proto's.
func TestLatencyAgainstPingPong(t *testing.T) {
	payload := Payload{Name: "random"}
	r := &Report{Config: Config{Concurrency: []int{1}, Payloads: []Payload{payload}}}
	p50 := map[string]float64{"tcp-socket": 10, "unix-socket": 5, "grpc-proto": 40, "trpc-tcp": 25, "trpc-shm": 15}
	for _, name := range []string{"tcp-socket", "unix-socket", "grpc-proto", "trpc-tcp", "trpc-shm"} {
		r.Cases = append(r.Cases, caseByName(name))
		r.Transfers = append(r.Transfers, Measurement{Kind: "transfer", Case: name, Payload: payload.Name, Bytes: 4096, Concurrency: 1, Reps: 1, Ops: 1, Seconds: 1, GBps: 1, P50us: p50[name], P99us: 2 * p50[name]})
	}
	var out bytes.Buffer
	writeTransfers(&out, r)
	text := out.String()
	want := map[string]string{
		"| trpc-tcp |":    "| 2.50× | 0.62× |", // 25 µs over tcp-socket's 10, over grpc-proto's 40
		"| trpc-shm |":    "| 3.00× | 0.38× |", // 15 over unix-socket's 5
		"| tcp-socket |":  "| - | 0.25× |",     // a ceiling has no ping-pong
		"| grpc-proto |":  "| 4.00× | 1.00× |",
		"| unix-socket |": "| - | 0.12× |",
	}
	if !strings.Contains(text, "vs its ping-pong") {
		t.Fatalf("no ping-pong column:\n%s", text)
	}
	for prefix, cells := range want {
		found := false
		for _, line := range strings.Split(text, "\n") {
			if strings.HasPrefix(line, prefix) && strings.Contains(line, " / ") {
				found = true
				if !strings.HasSuffix(line, cells) {
					t.Errorf("latency row %q, want it to end in %q", line, cells)
				}
			}
		}
		if !found {
			t.Errorf("no latency row for %s in:\n%s", prefix, text)
		}
	}
}
