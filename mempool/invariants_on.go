//go:build invariants || race

package mempool

// invariants turns on the allocator's self-checks: the chunk lists and bins
// are verified after every operation, and a double Release panics. It is on
// under the invariants build tag and under -race.
const invariants = true
