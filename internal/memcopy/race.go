//go:build race || asan || msan

package memcopy

// checked is true under the race detector and the address and memory
// sanitizers, which instrument the built-in copy but not assembly: Copy
// then always uses the built-in copy, so what it copies stays checked.
const checked = true
