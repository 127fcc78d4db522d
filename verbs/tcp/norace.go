//go:build !race

package tcp

// raceEnabled is true in race-detector builds; see race.go.
const raceEnabled = false
