//go:build !amd64

package memcopy

func haveLoop() bool             { return false }
func whyNot() string             { return "not amd64" }
func loop(dst, src []byte)       { copy(dst, src) }
func uintptrOf(b []byte) uintptr { return 0 }
func overlap(a, b []byte) bool   { return true }
