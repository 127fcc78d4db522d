package shm

import (
	"errors"
	"fmt"
	"strings"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// infoMagic begins shm's connection info (see softrc.Info), which carries
// the host identity and the domain's socket address: "@name" (abstract) or
// an absolute path.
const infoMagic = "TRSM"

// maxAddrLen is the longest unix socket address: sun_path is 108 bytes,
// the abstract form spends one on the leading NUL ('@' here).
const maxAddrLen = 107

// parseInfo decodes connection info from an untrusted peer. shm has no
// roles. Every failure wraps verbs.ErrInvalidInfo.
func parseInfo(b []byte) (softrc.Info, error) {
	return softrc.ParseInfo("shm", infoMagic, b, func(in *softrc.Info) error {
		switch {
		case in.Role != verbs.RoleAny:
			return fmt.Errorf("role %v, but shm queue pairs have none", in.Role)
		case len(in.Addr) == 0 || len(in.Addr) > maxAddrLen:
			return fmt.Errorf("socket address length %d out of range 1..%d", len(in.Addr), maxAddrLen)
		case in.Addr[0] != '@' && in.Addr[0] != '/':
			return fmt.Errorf("socket address %q is neither abstract (@) nor absolute", in.Addr)
		case strings.IndexByte(in.Addr, 0) >= 0:
			return errors.New("socket address contains NUL")
		}
		return nil
	})
}
