package memcopy

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"testing"
)

func TestCopyMatchesBuiltin(t *testing.T) {
	if ok, why := Active(); !ok {
		t.Logf("Copy's loop is off here (%s): checking the built-in path only", why)
	}
	r := rand.New(rand.NewPCG(1, 2))
	src := make([]byte, 3*MinBytes+1000)
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	sizes := []int{0, 1, 127, MinBytes - 1, MinBytes, MinBytes + 1, MinBytes + 127, 2*MinBytes + 4095, 3 * MinBytes}
	for _, direct := range []bool{false, true} {
		if direct && !canLoop() {
			continue
		}
		for _, n := range sizes {
			for _, offs := range [][2]int{{0, 0}, {1, 0}, {0, 7}, {31, 33}, {64, 3}} {
				dst := make([]byte, n+100)
				for i := range dst {
					dst[i] = 0xee
				}
				d, s := dst[offs[0]:offs[0]+n], src[offs[1]:offs[1]+n]
				if direct && n >= MinBytes {
					bulk(d, s) // the loop itself, also where Copy does not use it (race builds)
				} else if got := Copy(d, s); got != n {
					t.Fatalf("size %d offsets %v: Copy returned %d", n, offs, got)
				}
				if !bytes.Equal(d, s) {
					t.Fatalf("size %d offsets %v: bytes differ", n, offs)
				}
				for i, b := range dst {
					if (i < offs[0] || i >= offs[0]+n) && b != 0xee {
						t.Fatalf("size %d offsets %v: byte %d outside the copy written", n, offs, i)
					}
				}
			}
		}
	}
}

// useLoop: the loop from MinBytes up to the bound, when there is one.
func TestUseLoop(t *testing.T) {
	saved, savedMax := enabled, maxBytes
	defer func() { enabled, maxBytes = saved, savedMax }()
	enabled = true
	for _, c := range []struct {
		max, n int
		want   bool
	}{
		{0, MinBytes - 1, false}, {0, MinBytes, true}, {0, 1 << 30, true},
		{4 << 20, MinBytes, true}, {4 << 20, 4 << 20, true}, {4 << 20, 4<<20 + 1, false}, {4 << 20, 64 << 20, false},
	} {
		maxBytes = c.max
		if got := useLoop(c.n); got != c.want {
			t.Errorf("bound %d: useLoop(%d) = %v, want %v", c.max, c.n, got, c.want)
		}
	}
	enabled = false
	if useLoop(2 * MinBytes) {
		t.Error("useLoop with the loop off")
	}
}

func TestCopyShorterSide(t *testing.T) {
	src := bytes.Repeat([]byte{7}, 2*MinBytes)
	dst := make([]byte, MinBytes+5)
	if got := Copy(dst, src); got != len(dst) || !bytes.Equal(dst, src[:len(dst)]) {
		t.Fatalf("Copy into a shorter dst: %d", got)
	}
	dst = make([]byte, 2*MinBytes)
	if got := Copy(dst, src[:MinBytes+3]); got != MinBytes+3 || dst[MinBytes+3] != 0 {
		t.Fatalf("Copy from a shorter src: %d", got)
	}
}

// Overlapping ranges are copied as the built-in copy does (memmove).
func TestCopyOverlapping(t *testing.T) {
	for _, shift := range []int{1, 4096, -1, -4096} {
		buf := make([]byte, 3*MinBytes)
		for i := range buf {
			buf[i] = byte(i * 7)
		}
		want := append([]byte(nil), buf...)
		lo := MinBytes / 2
		n := 2 * MinBytes
		copy(want[lo+shift:lo+shift+n], want[lo:lo+n])
		Copy(buf[lo+shift:lo+shift+n], buf[lo:lo+n])
		if !bytes.Equal(buf, want) {
			t.Fatalf("shift %d: overlapping Copy differs from copy", shift)
		}
	}
}

func TestParseEnv(t *testing.T) {
	for _, v := range []string{"", "auto", "runtime", " Share"} {
		if err := ParseEnv(v); err != nil {
			t.Errorf("%q: %v", v, err)
		}
	}
	if err := ParseEnv("fast"); err == nil || !bytes.Contains([]byte(err.Error()), []byte(Env)) {
		t.Errorf("fast: %v, want an error naming %s", err, Env)
	}
	if parseEnv("runtime") || !parseEnv("auto") || !parseEnv("") {
		t.Error("parseEnv")
	}
}

// BenchmarkCopy compares the built-in copy, Copy, and Copy's loop alone
// (where the CPU can run it, whether or not Copy uses it), on hot buffers
// (the same pair each time) and on cold ones (pairs cycled over 96 MiB,
// more than the caches hold), from 256 KiB to 64 MiB: where the loop
// should stop (Limit) on a new CPU.
func BenchmarkCopy(b *testing.B) {
	for _, temp := range []string{"hot", "cold"} {
		for _, n := range []int{256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20} {
			k := 1
			if temp == "cold" {
				k = max((96<<20)/n, 2)
			}
			srcs, dsts := make([][]byte, k), make([][]byte, k)
			for j := range k {
				srcs[j], dsts[j] = make([]byte, n), make([]byte, n)
				for i := range srcs[j] {
					srcs[j][i], dsts[j][i] = byte(i), 1
				}
			}
			run := func(name string, f func(dst, src []byte)) {
				b.Run(fmt.Sprintf("%s/%s/%dKiB", temp, name, n>>10), func(b *testing.B) {
					b.SetBytes(int64(n))
					j := 0
					for b.Loop() {
						f(dsts[j], srcs[j])
						j = (j + 1) % k
					}
				})
			}
			run("builtin", func(dst, src []byte) { copy(dst, src) })
			run("Copy", func(dst, src []byte) { Copy(dst, src) })
			if canLoop() && n >= MinBytes {
				run("loop", bulk)
			}
		}
	}
}

// TestEnvRuntime: with TENSORRPC_COPY=runtime when the process starts,
// Copy never runs its loop and Active says why, and no copy is shared; a
// change of the environment afterwards changes none of it. Run in a child process, since
// the variable is read once.
func TestEnvRuntime(t *testing.T) {
	if os.Getenv("MEMCOPY_CHILD") == "1" {
		ok, why := Active()
		os.Setenv(Env, "auto")
		ok2, _ := Active()
		fmt.Printf("active=%v enabled=%v why=%q after=%v share=%v\n", ok, enabled, why, ok2, Sharing())
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^TestEnvRuntime$", "-test.count=1")
	cmd.Env = append(os.Environ(), "MEMCOPY_CHILD=1", Env+"= Runtime ")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	want := fmt.Sprintf("active=false enabled=false why=%q after=false share=false", Env+"=runtime")
	if !strings.Contains(string(out), want) {
		t.Fatalf("child said:\n%s\nwant a line %s", out, want)
	}
}
