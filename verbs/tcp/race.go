//go:build race

package tcp

// raceEnabled is true in race-detector builds, where the data path moves
// payloads through private buffers instead of zero-copy.
//
// The race detector learns that bytes written to a socket happen before
// the peer reads them from annotations in the write and read system calls,
// but their order defeats zero-copy: a write marks the user buffer as read
// only after it has published its happens-before edge, and a read marks
// the user buffer as written before it acquires the edge. Two queue pairs
// in one process that reuse a buffer across a round trip would then be
// reported as racing although the kernel orders them. In race builds the
// writer therefore copies every payload next to its header before the
// write and writes with write(2) (writev(2) carries no annotations), and the receiver reads payloads through the connection's read
// buffer and copies them after the read, so that every access to user
// memory is ordered by the annotations. Builds without -race are
// zero-copy, as documented.
const raceEnabled = true
