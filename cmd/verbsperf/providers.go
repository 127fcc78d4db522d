package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/shm"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// ceiling names what bounds a provider's medium, measured in the same run
// as the provider itself.
type ceiling int

const (
	// socketCeiling is a plain TCP socket between the same two ends.
	socketCeiling ceiling = iota
	// memcpyCeiling is one single-threaded copy of the payload.
	memcpyCeiling
	// noCeiling: nothing measurable in this process bounds the provider
	// (an RDMA NIC's bound is its line rate).
	noCeiling
)

func (c ceiling) String() string {
	switch c {
	case memcpyCeiling:
		return "memcpy"
	case noCeiling:
		return "none"
	}
	return "raw TCP socket"
}

// providerSpec is what verbsperf needs to know about a provider.
type providerSpec struct {
	// new returns the provider; host is the local address the peer reaches
	// this process on ("127.0.0.1" in loopback mode).
	new func(host string) verbs.Provider
	// newMemory returns registrable memory and a function that frees it.
	newMemory func(size int) (verbs.Memory, func(), error)
	ceiling   ceiling
	// sameHost says the provider only connects processes on one host.
	sameHost bool
}

// providers maps -provider names to providers. A new provider is one entry.
var providers = map[string]providerSpec{
	"tcp": {
		new: func(host string) verbs.Provider {
			return tcp.New(tcp.WithListenAddress(joinHostPort(host, "0")))
		},
		newMemory: heapMemory,
		ceiling:   socketCeiling,
	},
	"shm": {
		new:       func(string) verbs.Provider { return shm.New() },
		newMemory: memfdMemory,
		ceiling:   memcpyCeiling,
		sameHost:  true,
	},
}

// lookupProvider returns the provider named name, or an error that says
// how to get it: ibv needs a binary built with -tags rdma.
func lookupProvider(name string) (providerSpec, error) {
	if spec, ok := providers[name]; ok {
		return spec, nil
	}
	if name == "ibv" {
		return providerSpec{}, errors.New(ibvHint)
	}
	return providerSpec{}, fmt.Errorf("unknown provider %q; known: %s", name, strings.Join(providerNames(), ", "))
}

// ibvHint is the answer to -provider ibv in a binary without it.
const ibvHint = `provider "ibv" is not in this binary: build with -tags rdma (needs libibverbs-dev)`

// heapMemory is plain Go memory, for providers that need no file.
func heapMemory(size int) (verbs.Memory, func(), error) {
	return verbs.Memory{Bytes: make([]byte, size)}, func() {}, nil
}
