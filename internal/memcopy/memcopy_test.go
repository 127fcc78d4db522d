package memcopy

import (
	"bytes"
	"fmt"
	"math/rand/v2"
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
		if direct && !haveLoop() {
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
	for _, v := range []string{"", "auto", "runtime"} {
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

func BenchmarkCopy(b *testing.B) {
	for _, n := range []int{256 << 10, 1 << 20, 4 << 20, 16 << 20} {
		src := make([]byte, n)
		dst := make([]byte, n)
		for i := range src {
			src[i] = byte(i)
		}
		b.Run(fmt.Sprintf("builtin/%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(n))
			for b.Loop() {
				copy(dst, src)
			}
		})
		b.Run(fmt.Sprintf("Copy/%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(n))
			for b.Loop() {
				Copy(dst, src)
			}
		})
	}
}
