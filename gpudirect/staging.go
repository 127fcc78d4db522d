package gpudirect

import (
	"context"
	"fmt"

	"github.com/tensorrpc/tensorrpc/mempool"
)

// StageOut is the first hop of a staged send: it allocates length bytes from
// pool (whose arenas are pinned and registered with the data plane) and
// copies buf's bytes [offset, offset+length) into them. The transfer then
// sends from the returned buffer and releases it. It waits for pool memory
// as pool.Alloc does, until ctx ends.
//
// A staged send costs one device-to-host copy more than a direct one.
func StageOut(ctx context.Context, pool *mempool.Pool, buf DeviceBuffer, offset, length int) (*mempool.Buffer, error) {
	if err := checkRange(buf.Device(), buf.Len(), offset, length); err != nil {
		return nil, err
	}
	host, err := pool.Alloc(ctx, length)
	if err != nil {
		return nil, fmt.Errorf("gpudirect: staging %d bytes of %s: %w", length, buf.Device(), err)
	}
	if err := buf.CopyToHost(host.Bytes()[:length], offset); err != nil {
		host.Release()
		return nil, fmt.Errorf("gpudirect: staging %d bytes of %s: %w", length, buf.Device(), err)
	}
	return host, nil
}

// StageIn is the last hop of a staged receive: it copies the bytes that
// arrived in host memory into buf at offset. The caller still owns src (and
// releases the pool buffer it belongs to).
//
// A staged receive costs one host-to-device copy more than a direct one.
func StageIn(buf DeviceBuffer, offset int, src []byte) error {
	if err := buf.CopyFromHost(src, offset); err != nil {
		return fmt.Errorf("gpudirect: unstaging %d bytes into %s: %w", len(src), buf.Device(), err)
	}
	return nil
}
