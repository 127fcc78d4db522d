//go:build !linux

package gpudirect

import "runtime"

func osYield() { runtime.Gosched() }
