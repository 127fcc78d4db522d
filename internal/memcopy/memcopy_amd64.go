//go:build gc

package memcopy

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// copyBlocks copies n bytes, a multiple of 128 and more than 0, from src
// to dst with 256-bit loads and stores.
//
//go:noescape
func copyBlocks(dst, src *byte, n uintptr)

func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)

func loop(dst, src []byte) { copyBlocks(&dst[0], &src[0], uintptr(len(src))) }

func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

func overlap(a, b []byte) bool {
	pa, pb := uintptrOf(a), uintptrOf(b)
	return pa < pb+uintptr(len(b)) && pb < pa+uintptr(len(a))
}

// runtimeRepMovs reports whether the runtime's memmove prefers REP MOVSB
// for large copies on this CPU (as runtime/cpuflags_amd64.go decides: an
// Intel CPU with ERMS and FSRM): then it never runs the loop Copy replaces.
func runtimeRepMovs() bool {
	_, _, _, d7 := cpuid(7, 0)
	fsrm := d7&(1<<4) != 0
	return isIntel() && cpu.X86.HasERMS && fsrm
}

func isIntel() bool {
	_, b, c, d := cpuid(0, 0)
	return b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e // "GenuineIntel"
}

// loopMax is the largest copy Copy runs its loop for on this CPU, 0 for
// no bound. On Intel CPUs none: there the runtime's streaming loop was the
// slower at every size measured (the Xeon VM, up to 16 MiB; package
// comment). Elsewhere (AMD's, and CPUs derived from them) the runtime's
// streaming loop is the faster once the copy's two buffers no longer sit
// in the last-level cache, so the loop stops at an eighth of it (4 MiB of
// a 32 MiB L3); 4 MiB where the cache's size is not known.
func loopMax() int {
	if isIntel() {
		return 0
	}
	if llc := lastLevelCache(); llc > 0 {
		return max(llc/8, MinBytes)
	}
	return 4 << 20
}

// lastLevelCache is the size in bytes of the largest cache CPUID describes
// in AMD's cache topology leaf (0x8000001D, with the topology extensions),
// else in its L3 leaf (0x80000006), 0 when neither says.
func lastLevelCache() int {
	maxExt, _, _, _ := cpuid(0x80000000, 0)
	if maxExt >= 0x8000001d {
		if _, _, c, _ := cpuid(0x80000001, 0); c&(1<<22) != 0 {
			best := 0
			for i := uint32(0); i < 16; i++ {
				a, b, c, _ := cpuid(0x8000001d, i)
				size, ok := cacheLeafSize(a, b, c)
				if !ok {
					break
				}
				best = max(best, size)
			}
			if best > 0 {
				return best
			}
		}
	}
	if maxExt >= 0x80000006 {
		_, _, _, d := cpuid(0x80000006, 0)
		return l3Size(d)
	}
	return 0
}

// cacheLeafSize decodes one subleaf of CPUID 0x8000001D (the same layout
// as Intel's leaf 4): ways × partitions × line size × sets; ok false for
// the null entry that ends the list.
func cacheLeafSize(eax, ebx, ecx uint32) (size int, ok bool) {
	if eax&0x1f == 0 {
		return 0, false
	}
	ways := int(ebx>>22&0x3ff) + 1
	parts := int(ebx>>12&0x3ff) + 1
	line := int(ebx&0xfff) + 1
	sets := int(ecx) + 1
	return ways * parts * line * sets, true
}

// l3Size decodes EDX of CPUID 0x80000006 on AMD CPUs: bits 31-18, the L3
// size in 512 KiB units (at least; 0 without an L3).
func l3Size(edx uint32) int { return int(edx>>18) * (512 << 10) }

func haveLoop() bool { return canLoop() && !runtimeRepMovs() }

// canLoop reports whether this CPU can run copyBlocks at all (256-bit
// VMOVDQU needs AVX, with the OS saving the YMM registers, which
// x/sys/cpu checks), whether or not Copy uses it here.
func canLoop() bool { return cpu.X86.HasAVX }

func whyNot() string {
	if !cpu.X86.HasAVX {
		return "no AVX"
	}
	return "the runtime copies with REP MOVSB on this CPU"
}
