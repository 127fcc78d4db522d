//go:build !invariants && !race

package mempool

// invariants is off in ordinary builds; see invariants_on.go.
const invariants = false
