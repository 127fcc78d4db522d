//go:build !amd64 || !gc

package memcopy

func haveLoop() bool             { return false }
func loopMax() int               { return 0 }
func canLoop() bool              { return false }
func whyNot() string             { return "not amd64 with the gc toolchain" }
func loop(dst, src []byte)       { copy(dst, src) }
func uintptrOf(b []byte) uintptr { return 0 }
func overlap(a, b []byte) bool   { return true }
