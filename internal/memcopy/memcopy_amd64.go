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
	_, b, c, d := cpuid(0, 0)
	intel := b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e // "GenuineIntel"
	_, _, _, d7 := cpuid(7, 0)
	fsrm := d7&(1<<4) != 0
	return intel && cpu.X86.HasERMS && fsrm
}

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
