package units

import (
	"testing"
	"time"
)

func TestFormats(t *testing.T) {
	for d, want := range map[time.Duration]string{1500 * time.Nanosecond: "1.5 µs", 2500 * time.Microsecond: "2.50 ms", 3 * time.Second: "3.00 s"} {
		if got := Duration(d); got != want {
			t.Errorf("Duration(%v) = %q, want %q", d, got, want)
		}
	}
	for n, want := range map[int64]string{12: "12 B", 1536: "1.5 KiB", 3 << 20: "3 MiB"} {
		if got := Bytes(n); got != want {
			t.Errorf("Bytes(%d) = %q, want %q", n, got, want)
		}
	}
}
