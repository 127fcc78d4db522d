package memcopy

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// chunkCopier copies src into dst by chunks and records the ranges it
// was asked for.
type chunkCopier struct {
	dst, src []byte
	mu       sync.Mutex
	ranges   [][2]int
}

func (c *chunkCopier) copy(lo, hi int) int {
	c.mu.Lock()
	c.ranges = append(c.ranges, [2]int{lo, hi})
	c.mu.Unlock()
	return copy(c.dst[lo:hi], c.src[lo:hi])
}

func newCopier(n int) *chunkCopier {
	c := &chunkCopier{dst: make([]byte, n), src: make([]byte, n)}
	for i := range c.src {
		c.src[i] = byte(i*7 + i>>11)
	}
	return c
}

// withSharing turns sharing on for the test.
func withSharing(t *testing.T) {
	was := SetSharing(true)
	t.Cleanup(func() { SetSharing(was) })
}

// TestShareAlone: with sharing off, without a helper, below
// ShareMinBytes, or while another copy is being shared, Share makes the
// copy in one call, itself.
func TestShareAlone(t *testing.T) {
	Helping(true)
	c := newCopier(1 << 20)
	was := SetSharing(false)
	got := Share(len(c.src), c.copy)
	SetSharing(was)
	Helping(false)
	if got != len(c.src) || len(c.ranges) != 1 || !bytes.Equal(c.dst, c.src) {
		t.Errorf("sharing off: Share = %d, ranges %v", got, c.ranges)
	}
	withSharing(t)
	c = newCopier(1 << 20)
	if got := Share(len(c.src), c.copy); got != len(c.src) || len(c.ranges) != 1 || !bytes.Equal(c.dst, c.src) {
		t.Errorf("no helper: Share = %d, ranges %v", got, c.ranges)
	}
	Helping(true)
	defer Helping(false)
	small := newCopier(ShareMinBytes - 1)
	if got := Share(len(small.src), small.copy); got != len(small.src) || len(small.ranges) != 1 {
		t.Errorf("below ShareMinBytes: Share = %d, ranges %v", got, small.ranges)
	}
	other := &shared{n: 1}
	sharing.Store(other)
	c = newCopier(1 << 20)
	got = Share(len(c.src), c.copy)
	sharing.CompareAndSwap(other, nil)
	if got != len(c.src) || len(c.ranges) != 1 || !bytes.Equal(c.dst, c.src) {
		t.Errorf("another copy shared: Share = %d, ranges %v", got, c.ranges)
	}
}

// TestShareWaitsForTheHelpersChunks: a helper that calls Help while a
// copy is shared takes chunks of it, and Share returns only once the
// chunks the helper took are copied (a Read must not complete before its
// last byte is in place).
func TestShareWaitsForTheHelpersChunks(t *testing.T) {
	defer leakcheck.Check(t)
	withSharing(t)
	c := newCopier(1 << 20)
	inHelper, release := make(chan struct{}), make(chan struct{})
	callerChunks := make(chan int, 16)
	f := func(lo, hi int) int {
		switch lo {
		case 0:
			<-inHelper // the caller's first chunk: on once the helper is in its own
		case shareChunk:
			close(inHelper) // the helper's first chunk: held until released
			<-release
		default:
			callerChunks <- lo
		}
		return c.copy(lo, hi)
	}
	Helping(true)
	helped := make(chan bool)
	go func() {
		for sharing.Load() == nil {
			time.Sleep(10 * time.Microsecond)
		}
		helped <- Help()
	}()
	returned := make(chan int)
	go func() { returned <- Share(len(c.src), f) }()
	// The caller copies every other chunk, then waits for the helper's.
	for range len(c.src)/shareChunk - 2 {
		<-callerChunks
	}
	select {
	case got := <-returned:
		t.Fatalf("Share returned %d while the helper still copied its chunk", got)
	case <-time.After(20 * time.Millisecond):
	}
	close(release)
	if !<-helped {
		t.Error("Help took no chunk of the copy being shared")
	}
	Helping(false)
	if got := <-returned; got != len(c.src) || !bytes.Equal(c.dst, c.src) {
		t.Fatalf("Share = %d; the copy differs", got)
	}
	if len(c.ranges) != len(c.src)/shareChunk {
		t.Errorf("%d chunks copied, want %d", len(c.ranges), len(c.src)/shareChunk)
	}
	if Help() {
		t.Error("Help took a chunk after the copy ended")
	}
}

// TestShareWithHelpersAtWork: copies of many sizes from several
// goroutines at once, with helpers taking chunks all the while, all
// arrive whole, each chunk copied once.
func TestShareWithHelpersAtWork(t *testing.T) {
	defer leakcheck.Check(t)
	withSharing(t)
	stop := make(chan struct{})
	var helpers sync.WaitGroup
	for range 3 {
		helpers.Go(func() {
			Helping(true)
			defer Helping(false)
			for {
				select {
				case <-stop:
					return
				default:
				}
				if !Help() {
					runtime.Gosched()
				}
			}
		})
	}
	var copiers sync.WaitGroup
	for g := range 3 {
		copiers.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for range 25 {
				n := ShareMinBytes/2 + r.IntN(3<<20)
				c := newCopier(n)
				if got := Share(n, c.copy); got != n || !bytes.Equal(c.dst, c.src) {
					t.Errorf("%d bytes: Share = %d, or the copy differs", n, got)
					return
				}
				total := 0
				for _, rg := range c.ranges {
					total += rg[1] - rg[0]
				}
				if total != n {
					t.Errorf("%d bytes: chunks of %d bytes in all (%d chunks)", n, total, len(c.ranges))
					return
				}
			}
		})
	}
	copiers.Wait()
	close(stop)
	helpers.Wait()
}

// TestEnvShare: TENSORRPC_COPY=share when the process starts turns
// sharing on (a copy with a helper about is made in chunks), with Copy's
// loop as with auto; without it, sharing is off.
func TestEnvShare(t *testing.T) {
	if os.Getenv("MEMCOPY_CHILD") == "1" {
		Helping(true)
		c := newCopier(1 << 20)
		Share(len(c.src), c.copy)
		ok, _ := Active()
		fmt.Printf("share=%v active=%v chunks=%d\n", Sharing(), ok == (haveLoop() && !checked), len(c.ranges))
		return
	}
	for v, want := range map[string]string{
		"share": "share=true active=true chunks=16",
		"auto":  "share=false active=true chunks=1",
	} {
		cmd := exec.Command(os.Args[0], "-test.run", "^TestEnvShare$", "-test.count=1")
		cmd.Env = append(os.Environ(), "MEMCOPY_CHILD=1", Env+"="+v)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("child: %v\n%s", err, out)
		}
		if !strings.Contains(string(out), want) {
			t.Errorf("%s=%s: child said:\n%s\nwant a line %s", Env, v, out, want)
		}
	}
}
