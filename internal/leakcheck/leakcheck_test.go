package leakcheck

import (
	"fmt"
	"testing"
	"time"
)

type recorder struct{ errs []string }

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func TestCheckFindsLeak(t *testing.T) {
	stop := make(chan struct{})
	go func() { <-stop }()
	old := Timeout
	Timeout = 50 * time.Millisecond
	defer func() { Timeout = old }()
	var r recorder
	Check(&r)
	if len(r.errs) != 1 {
		t.Fatalf("Check reported %d leaks, want 1: %q", len(r.errs), r.errs)
	}
	close(stop)
	r = recorder{}
	Timeout = time.Second
	Check(&r)
	if len(r.errs) != 0 {
		t.Fatalf("Check reported leaks after the goroutine ended: %q", r.errs)
	}
}
