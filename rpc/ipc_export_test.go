package rpc

import "github.com/tensorrpc/tensorrpc/gpudirect"

// IPCDriver is what CUDA IPC needs of a driver, for tests that fake one.
type IPCDriver interface {
	DeviceUUIDs() ([][16]byte, error)
	OpenIPC(h gpudirect.IPCHandle) (gpudirect.DeviceBuffer, error)
}

// WithIPCDriver is WithCUDA with a fake driver.
func WithIPCDriver(d IPCDriver) Option {
	return sharedOption(func(o *options) { o.cuda = d })
}

// WithIPCHost overrides the host identity CUDA IPC compares.
func WithIPCHost(id string) Option {
	return sharedOption(func(o *options) { o.ipcHost = id })
}

// WithIPCProcess overrides the process identity CUDA IPC compares, so
// that a Server and a Client of one test process may use it.
func WithIPCProcess(id string) Option {
	return sharedOption(func(o *options) { o.ipcProcess = id })
}

// IPCHandleCounts returns how many IPC handles the client's session opened
// and closed.
func IPCHandleCounts(c *Client) (opened, closed int) {
	c.mu.Lock()
	s := c.last
	c.mu.Unlock()
	if s == nil || s.ipc == nil {
		return 0, 0
	}
	return s.ipc.cache.counts()
}
