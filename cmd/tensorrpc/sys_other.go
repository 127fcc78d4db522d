//go:build !linux

package main

import (
	"fmt"
	"runtime"
)

const unlimited = ^uint64(0)

var errNotLinux = fmt.Errorf("not supported on %s: tensorrpc's shared memory and pinning are Linux-only", runtime.GOOS)

func memlockLimit() (soft, hard uint64, err error) { return 0, 0, errNotLinux }

func tryMemfd() (memfdErr, sealErr error) { return errNotLinux, nil }
