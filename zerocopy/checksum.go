package zerocopy

import "hash/crc32"

// castagnoli is the CRC32C table. hash/crc32 computes it with the SSE4.2
// CRC32 instruction on amd64 and the CRC32C instructions on arm64.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum returns the CRC32C (Castagnoli) checksum of b.
func Checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// UpdateChecksum extends a CRC32C checksum with b, for data that arrives in
// pieces: UpdateChecksum(Checksum(a), b) == Checksum(append(a, b...)).
func UpdateChecksum(crc uint32, b []byte) uint32 { return crc32.Update(crc, castagnoli, b) }
