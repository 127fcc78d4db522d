package suite

import (
	"bytes"
	"fmt"
	"io"
	"time"

	"google.golang.org/grpc/encoding"
)

// CodecResult is one compressor on one payload, measured through the same
// encoding.Compressor the gRPC cases use.
type CodecResult struct {
	Kind            string  `json:"kind"` // "codec"
	Codec           string  `json:"codec"`
	Payload         string  `json:"payload"`
	Bytes           int64   `json:"bytes"`
	CompressedBytes int64   `json:"compressed_bytes"`
	Ratio           float64 `json:"ratio"` // bytes / compressed bytes
	// CompressMBps and DecompressMBps are uncompressed MB (1e6 bytes) per
	// second on one core, medians over the reps.
	CompressMBps   float64 `json:"compress_mb_per_s"`
	DecompressMBps float64 `json:"decompress_mb_per_s"`
	// BreakEvenGbps is the link speed in Gb/s (1e9 bits) above which
	// compress, send, decompress one after the other is slower than
	// sending the raw bytes; 0 when the codec never wins (ratio ≤ 1).
	BreakEvenGbps float64 `json:"break_even_gbps"`
	// PipelinedBreakEvenGbps is the same for a perfectly overlapped
	// pipeline: an upper bound no real sender reaches.
	PipelinedBreakEvenGbps float64 `json:"pipelined_break_even_gbps"`
}

// breakEven returns the link bandwidths, in bytes per second, below which
// compressing pays: serial, where compressing (cc bytes/s), sending the
// compressed bytes and decompressing (cd bytes/s) happen one after the
// other, and pipelined, where they overlap perfectly. ratio is
// uncompressed/compressed.
//
// Serial: raw costs n/B, compressed n/cc + n/(r·B) + n/cd; compressing wins
// iff n/B > n/cc + n/(r·B) + n/cd, i.e. B < (1 - 1/r) / (1/cc + 1/cd).
// Pipelined: the slowest stage sets the pace, max(n/cc, n/(r·B), n/cd)
// < n/B iff B < min(cc, cd) (for r > 1).
func breakEven(ratio, cc, cd float64) (serial, pipelined float64) {
	if ratio <= 1 || cc <= 0 || cd <= 0 {
		return 0, 0
	}
	return (1 - 1/ratio) / (1/cc + 1/cd), min(cc, cd)
}

// runCodecs measures every compressor on every payload at size bytes.
func runCodecs(src *payloadSource, payloads []Payload, comps []encoding.Compressor, size, reps int, progress func(string)) ([]CodecResult, error) {
	var out []CodecResult
	data := make([]byte, size)
	restored := make([]byte, size)
	var compressed bytes.Buffer
	for _, p := range payloads {
		src.fill(p, data)
		for _, c := range comps {
			var cTimes, dTimes []float64
			for range max(reps, 1) + 1 { // the first round warms the pools
				compressed.Reset()
				t0 := time.Now()
				w, err := c.Compress(&compressed)
				if err != nil {
					return nil, err
				}
				if _, err := w.Write(data); err != nil {
					return nil, err
				}
				if err := w.Close(); err != nil {
					return nil, err
				}
				ct := time.Since(t0)
				t0 = time.Now()
				r, err := c.Decompress(bytes.NewReader(compressed.Bytes()))
				if err != nil {
					return nil, err
				}
				if _, err := io.ReadFull(r, restored); err != nil {
					return nil, fmt.Errorf("%s: decompress: %w", c.Name(), err)
				}
				if rc, ok := r.(io.Closer); ok {
					rc.Close()
				}
				dt := time.Since(t0)
				cTimes = append(cTimes, float64(size)/ct.Seconds())
				dTimes = append(dTimes, float64(size)/dt.Seconds())
			}
			if !bytes.Equal(data, restored) {
				return nil, fmt.Errorf("%s on %s: round trip differs", c.Name(), p.Name)
			}
			cc, cd := median(cTimes[1:]), median(dTimes[1:])
			ratio := float64(size) / float64(compressed.Len())
			serial, pipelined := breakEven(ratio, cc, cd)
			r := CodecResult{
				Kind: "codec", Codec: c.Name(), Payload: p.Name, Bytes: int64(size),
				CompressedBytes: int64(compressed.Len()), Ratio: ratio,
				CompressMBps: cc / 1e6, DecompressMBps: cd / 1e6,
				BreakEvenGbps: serial * 8 / 1e9, PipelinedBreakEvenGbps: pipelined * 8 / 1e9,
			}
			progress(fmt.Sprintf("codec %-16s %-11s ratio %6.2f  compress %7.0f MB/s  decompress %7.0f MB/s  break-even %6.2f Gb/s",
				c.Name(), p.Name, r.Ratio, r.CompressMBps, r.DecompressMBps, r.BreakEvenGbps))
			out = append(out, r)
		}
	}
	return out, nil
}
