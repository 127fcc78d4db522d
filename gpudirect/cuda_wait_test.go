package gpudirect_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/gpudirect"
	"github.com/tensorrpc/tensorrpc/gpudirect/cudatest"
)

// BenchmarkEventWait: how long Event.Wait takes past the end of a copy,
// on the driver emulator with each copy made to last 50 µs to 3 ms
// (FAKECUDA_COPY_DELAY_US; staged chunks and CUDA IPC copies on an H100
// take that long): an event that is waited for with sleeps shorter than
// the Go runtime's (about a millisecond when the process is otherwise
// idle) returns up to a millisecond late. Reports the p50 of Wait's
// return past the copy's delay, in µs.
func BenchmarkEventWait(b *testing.B) {
	for _, us := range []int{50, 200, 800, 3000} {
		b.Run(fmt.Sprint(us, "us"), func(b *testing.B) {
			b.Setenv("FAKECUDA_COPY_DELAY_US", fmt.Sprint(us))
			c, err := gpudirect.LoadCUDA(gpudirect.WithCUDALibrary(cudatest.Library(b)))
			if err != nil {
				b.Fatal(err)
			}
			a, err := c.NewAllocator(0, 8<<20, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer a.Close()
			var bufs []gpudirect.AsyncBuffer
			for range 2 {
				buf, err := a.Alloc(4 << 10)
				if err != nil {
					b.Fatal(err)
				}
				defer buf.Free()
				bufs = append(bufs, buf.(gpudirect.AsyncBuffer))
			}
			st, err := bufs[0].NewStream()
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			ctx := context.Background()
			var over []time.Duration
			for b.Loop() {
				t0 := time.Now()
				if err := st.CopyDevice(bufs[1], 0, bufs[0], 0, 4<<10); err != nil {
					b.Fatal(err)
				}
				ev, err := st.Record()
				if err != nil {
					b.Fatal(err)
				}
				if err := ev.Wait(ctx); err != nil {
					b.Fatal(err)
				}
				over = append(over, time.Since(t0)-time.Duration(us)*time.Microsecond)
				ev.Close()
			}
			slices.Sort(over)
			b.ReportMetric(float64(over[len(over)/2].Nanoseconds())/1e3, "late-µs")
		})
	}
}
