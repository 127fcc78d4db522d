//go:build !race && !asan && !msan

package memcopy

const checked = false
