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
			if resp.StatusCode == http.StatusOK && strings.Contains(body, "rpc_client_duration") {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no metrics served: %v\n%s", err, body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, side := range []string{"client", "server"} {
		for _, op := range []string{"Fetch", "Send", "Call"} {
			re := regexp.MustCompile(`(?m)^rpc_` + side + `_duration_milliseconds_count\{[^}]*tensorrpc_operation="` + op + `"[^}]*\} 100$`)
			if !re.MatchString(body) {
				t.Errorf("/metrics lacks 100 %s %ss:\n%s", side, op, grep(body, "duration_milliseconds_count"))
			}
		}
	}
	if !regexp.MustCompile(`(?m)^tensorrpc_transfers(_total)?\{[^}]*tensorrpc_role="client"[^}]*\} [1-9]`).MatchString(body) {
		t.Errorf("/metrics lacks the client's transfers counter:\n%s", grep(body, "tensorrpc_"))
	}
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
