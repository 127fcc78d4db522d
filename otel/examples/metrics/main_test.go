package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// TestScrape: after 300 calls, a scrape of /metrics has the duration
// histograms of both sides with 100 of each operation, and the client's
// counters.
func TestScrape(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	go func() { done <- run(ctx, lis, "tcp", 300, false, devnull) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	var body string
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + lis.Addr().String() + "/metrics")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			body = string(b)
			// Until both sides have recorded every call: the server
			// records one once its answer has gone.
			if resp.StatusCode == http.StatusOK && allCounted(body) {
				break
			}
		}
		if time.Now().After(deadline) {
			if body == "" {
				t.Fatalf("no metrics served: %v", err)
			}
			break // the check below says what is missing
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !allCounted(body) {
		t.Errorf("/metrics lacks 100 calls of each operation on each side:\n%s", grep(body, "duration_milliseconds_count"))
	}
	if !regexp.MustCompile(`(?m)^tensorrpc_transfers(_total)?\{[^}]*tensorrpc_role="client"[^}]*\} [1-9]`).MatchString(body) {
		t.Errorf("/metrics lacks the client's transfers counter:\n%s", grep(body, "tensorrpc_"))
	}
}

// allCounted reports whether body has the duration histograms of both
// sides with 100 of each operation.
func allCounted(body string) bool {
	for _, side := range []string{"client", "server"} {
		for _, op := range []string{"Fetch", "Send", "Call"} {
			re := regexp.MustCompile(`(?m)^rpc_` + side + `_duration_milliseconds_count\{[^}]*tensorrpc_operation="` + op + `"[^}]*\} 100$`)
			if !re.MatchString(body) {
				return false
			}
		}
	}
	return true
}

func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
