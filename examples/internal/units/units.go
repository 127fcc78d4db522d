// Package units formats durations for the examples' reports (byte counts:
// internal/bytesize).
package units

import (
	"fmt"
	"time"
)

// Duration formats d in µs, ms or s, whichever reads best.
func Duration(d time.Duration) string {
	switch {
	case d < time.Millisecond:
		return fmt.Sprintf("%.1f µs", float64(d)/float64(time.Microsecond))
	case d < time.Second:
		return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%.2f s", d.Seconds())
}
