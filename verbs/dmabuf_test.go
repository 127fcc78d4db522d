package verbs_test

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/shm"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// TestSoftwareProvidersRefuseDMABuf: device memory exported as a DMA-BUF
// holds addresses the CPU must not touch, so the software providers refuse
// it instead of reading it.
func TestSoftwareProvidersRefuseDMABuf(t *testing.T) {
	defer leakcheck.Check(t)
	fd, err := unix.MemfdCreate("dmabuf-stand-in", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	m := verbs.Memory{Bytes: make([]byte, 4096), HasFD: true, FD: fd, DMABuf: true}
	for _, p := range []verbs.Provider{tcp.New(), shm.New()} {
		pd, err := p.Open("")
		if err != nil {
			t.Fatalf("%s: %v", p.Name(), err)
		}
		if _, err := pd.RegisterMemory(m, verbs.AccessLocalWrite); !errors.Is(err, verbs.ErrInvalidMemory) {
			t.Errorf("%s registered DMA-BUF memory: %v", p.Name(), err)
		}
		pd.Close()
	}
}
