//go:build gc

package memcopy

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// cacheLeafSize and l3Size decode what AMD's manuals lay out: a 32 MiB,
// 16-way L3 of 64-byte lines in 32768 sets, one partition.
func TestCacheLeafDecoding(t *testing.T) {
	eax := uint32(3)<<5 | 3 // level 3, unified
	ebx := uint32(15)<<22 | uint32(0)<<12 | 63
	if got, ok := cacheLeafSize(eax, ebx, 32767); !ok || got != 32<<20 {
		t.Errorf("cacheLeafSize = %d, %v; want 32 MiB", got, ok)
	}
	if _, ok := cacheLeafSize(0, ebx, 32767); ok {
		t.Error("the null subleaf (type 0) decoded as a cache")
	}
	if got := l3Size(64 << 18); got != 32<<20 {
		t.Errorf("l3Size = %d, want 32 MiB", got)
	}
	if got := l3Size(0x1ff); got != 0 {
		t.Errorf("l3Size without an L3 = %d, want 0", got)
	}
}

// On a CPU other than Intel's, the loop's bound follows the last-level
// cache CPUID reports, which Linux reports in sysfs too.
func TestLoopMaxFollowsTheCache(t *testing.T) {
	if isIntel() {
		if loopMax() != 0 {
			t.Fatalf("loopMax = %d on an Intel CPU, want 0 (no bound)", loopMax())
		}
		t.Skip("needs a CPU that is not Intel's; this one is (the loop has no size bound there, and no cache size is read)")
	}
	llc := lastLevelCache()
	if want := max(llc/8, MinBytes); llc > 0 && loopMax() != want {
		t.Fatalf("loopMax = %d with a %d-byte cache, want %d", loopMax(), llc, want)
	}
	dirs, _ := filepath.Glob("/sys/devices/system/cpu/cpu0/cache/index*")
	sysfs := 0
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "size"))
		if err != nil {
			continue
		}
		s := strings.TrimSpace(string(b))
		if k, err := strconv.Atoi(strings.TrimSuffix(s, "K")); err == nil && strings.HasSuffix(s, "K") {
			sysfs = max(sysfs, k<<10)
		}
	}
	if sysfs == 0 {
		t.Skipf("needs the cache sizes under /sys/devices/system/cpu/cpu0/cache, absent here, to compare CPUID's %d bytes with", llc)
	}
	if llc != sysfs {
		t.Fatalf("lastLevelCache = %d bytes, sysfs says %d", llc, sysfs)
	}
	t.Logf("last-level cache %d MiB: the loop runs up to %d MiB", llc>>20, loopMax()>>20)
}
