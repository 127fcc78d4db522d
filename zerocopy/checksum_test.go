package zerocopy

import (
	"hash/crc32"
	"math/rand/v2"
	"testing"
)

// bitwiseCRC32C is a slow reference implementation of CRC32C (reflected
// polynomial 0x82F63B78).
func bitwiseCRC32C(b []byte) uint32 {
	crc := ^uint32(0)
	for _, c := range b {
		crc ^= uint32(c)
		for range 8 {
			if crc&1 != 0 {
				crc = crc>>1 ^ 0x82F63B78
			} else {
				crc >>= 1
			}
		}
	}
	return ^crc
}

func TestChecksum(t *testing.T) {
	// The standard check value of CRC-32C.
	if got := Checksum([]byte("123456789")); got != 0xE3069283 {
		t.Fatalf("Checksum(123456789) = %#x, want 0xe3069283", got)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 1, 7, 64, 1000, 4096, 65537} {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		if got, want := Checksum(b), bitwiseCRC32C(b); got != want {
			t.Errorf("n=%d: Checksum = %#x, reference %#x", n, got, want)
		}
		h := n / 3
		if got := UpdateChecksum(Checksum(b[:h]), b[h:]); got != Checksum(b) {
			t.Errorf("n=%d: incremental checksum %#x != %#x", n, got, Checksum(b))
		}
	}
}

func BenchmarkChecksum1MiB(b *testing.B) {
	buf := make([]byte, 1<<20)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		Checksum(buf)
	}
	_ = crc32.IEEE
}
