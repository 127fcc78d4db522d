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
}
