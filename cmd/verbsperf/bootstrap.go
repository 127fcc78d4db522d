package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"
)

// The bootstrap connection carries length-prefixed JSON messages (a 4-byte
// little-endian length, then the JSON), and afterwards serves as the raw
// socket ceiling between the two processes.

// hello opens a session: the client's test, its queue pair's info and its
// buffer.
type hello struct {
	Provider string
	Params   params
	Info     []byte
	Region   regionDesc
}

// reply answers a hello with the server's info and buffer, or an error.
type reply struct {
	Info   []byte
	Region regionDesc
	Error  string
}

// control ends a session's test (Done) or asks for a ceiling measurement.
type control struct {
	Done    bool
	Ceiling string // "bw" or "lat"
	Bytes   int64  // bw: bytes the client will write
	Size    int
	Iters   int // lat: round trips
	Error   string
}

const maxMessage = 1 << 20

// unbounded is the duration of ceiling runs over the bootstrap connection:
// the server expects exactly as many bytes or round trips as the test made,
// so they are bounded by that count instead.
const unbounded = time.Duration(1 << 62)

func writeMessage(c net.Conn, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	msg := binary.LittleEndian.AppendUint32(make([]byte, 0, 4+len(b)), uint32(len(b)))
	_, err = c.Write(append(msg, b...))
	return err
}

func readMessage(c net.Conn, v any) error {
	var n [4]byte
	if _, err := io.ReadFull(c, n[:]); err != nil {
		return err
	}
	size := binary.LittleEndian.Uint32(n[:])
	if size > maxMessage {
		return fmt.Errorf("bootstrap message of %d bytes is too large", size)
	}
	b := make([]byte, size)
	if _, err := io.ReadFull(c, b); err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// localHost is the address this end of c is reached on.
func localHost(c net.Conn) string {
	host, _, err := net.SplitHostPort(c.LocalAddr().String())
	if err != nil {
		return "127.0.0.1"
	}
	return host
}

func joinHostPort(host, port string) string { return net.JoinHostPort(host, port) }

// serve accepts one client on port and serves its sessions until it
// disconnects.
func serve(port int, timeout time.Duration) error {
	ln, err := net.Listen("tcp", net.JoinHostPort("", strconv.Itoa(port)))
	if err != nil {
		return fmt.Errorf("listening for the client: %w", err)
	}
	defer ln.Close()
	fmt.Printf("verbsperf: waiting for a client on %s\n", ln.Addr())
	c, err := ln.Accept()
	if err != nil {
		return fmt.Errorf("accepting the client: %w", err)
	}
	defer c.Close()
	for {
		var h hello
		c.SetReadDeadline(time.Now().Add(timeout))
		if err := readMessage(c, &h); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("reading the client's hello: %w", err)
		}
		c.SetReadDeadline(time.Time{})
		if err := serveSession(c, h, timeout); err != nil {
			return err
		}
	}
}

func serveSession(c net.Conn, h hello, timeout time.Duration) error {
	spec, err := lookupProvider(h.Provider)
	if err != nil {
		writeMessage(c, reply{Error: "server: " + err.Error()})
		return fmt.Errorf("client asked for provider %q: %w", h.Provider, err)
	}
	if _, known := tests[h.Params.Test]; !known {
		writeMessage(c, reply{Error: fmt.Sprintf("unknown test %q", h.Params.Test)})
		return fmt.Errorf("client asked for test %q", h.Params.Test)
	}
	e, err := newEndpoint(spec, localHost(c), h.Params.Size, h.Params.Depth)
	if err != nil {
		writeMessage(c, reply{Error: err.Error()})
		return err
	}
	defer e.close()
	if err := writeMessage(c, reply{Info: e.qp.LocalInfo(), Region: e.desc()}); err != nil {
		return fmt.Errorf("answering the client: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	err = e.qp.Connect(ctx, h.Info)
	cancel()
	if err != nil {
		return fmt.Errorf("connecting to the client: %w", err)
	}
	// The passive side runs until the client says the test is done; the
	// test's own duration plus the timeout bounds it regardless.
	ctx, cancel = context.WithTimeout(context.Background(), h.Params.Duration+timeout)
	defer cancel()
	passive := make(chan error, 1)
	go func() { passive <- runPassive(ctx, e, h.Region, h.Params) }()
	var done control
	readErr := readMessage(c, &done)
	cancel()
	if err := <-passive; err != nil {
		return fmt.Errorf("serving %s: %w", h.Params.Test, err)
	}
	if readErr != nil {
		return fmt.Errorf("waiting for the client to finish: %w", readErr)
	}
	e.close()
	if err := writeMessage(c, control{Done: true}); err != nil {
		return err
	}
	// An optional ceiling measurement over this connection follows.
	var ceil control
	if err := readMessage(c, &ceil); err != nil {
		return fmt.Errorf("reading the ceiling request: %w", err)
	}
	switch ceil.Ceiling {
	case "bw":
		err = sink(c, ceil.Size, ceil.Bytes)
	case "lat":
		err = echo(c, ceil.Size, ceil.Iters)
	}
	if err != nil {
		return err
	}
	return writeMessage(c, control{Done: true})
}

// client runs each size's session against the server at addr.
type client struct {
	c    net.Conn
	spec providerSpec
	name string
}

func dialServer(addr string, port int, timeout time.Duration) (net.Conn, error) {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		addr = net.JoinHostPort(addr, strconv.Itoa(port))
	}
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return nil, fmt.Errorf("dialing the server: %w", err)
	}
	return c, nil
}

// session runs one measurement and, unless noCeiling, its ceiling over the
// bootstrap connection.
func (cl *client) session(p params, noCeiling bool, timeout time.Duration) (res, ceil result, err error) {
	e, err := newEndpoint(cl.spec, localHost(cl.c), p.Size, p.Depth)
	if err != nil {
		return res, ceil, err
	}
	defer e.close()
	if err := writeMessage(cl.c, hello{Provider: cl.name, Params: p, Info: e.qp.LocalInfo(), Region: e.desc()}); err != nil {
		return res, ceil, fmt.Errorf("sending the hello: %w", err)
	}
	var r reply
	if err := readMessage(cl.c, &r); err != nil {
		return res, ceil, fmt.Errorf("reading the server's reply: %w", err)
	}
	if r.Error != "" {
		return res, ceil, fmt.Errorf("server: %s", r.Error)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	err = e.qp.Connect(ctx, r.Info)
	cancel()
	if err != nil {
		return res, ceil, fmt.Errorf("connecting to the server: %w", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), p.Duration+timeout)
	res, err = runActive(ctx, e, r.Region, p)
	cancel()
	if err != nil {
		return res, ceil, err
	}
	if err := writeMessage(cl.c, control{Done: true}); err != nil {
		return res, ceil, err
	}
	var ack control
	if err := readMessage(cl.c, &ack); err != nil {
		return res, ceil, fmt.Errorf("waiting for the server to finish: %w", err)
	}
	latency := tests[p.Test].latency
	switch {
	case noCeiling || cl.spec.ceiling != socketCeiling:
		err = writeMessage(cl.c, control{})
	case latency:
		if err = writeMessage(cl.c, control{Ceiling: "lat", Size: p.Size, Iters: res.iters}); err == nil {
			ceil, err = socketLatency(cl.c, p.Size, res.iters, unbounded)
		}
	default:
		if err = writeMessage(cl.c, control{Ceiling: "bw", Size: p.Size, Bytes: res.bytes}); err == nil {
			ceil, err = socketBandwidth(cl.c, p.Size, res.iters, unbounded, func() error {
				var done control
				return readMessage(cl.c, &done)
			})
		}
	}
	if err != nil {
		return res, ceil, err
	}
	if noCeiling || cl.spec.ceiling != socketCeiling || latency {
		var done control
		if err := readMessage(cl.c, &done); err != nil {
			return res, ceil, err
		}
	}
	if !noCeiling && cl.spec.ceiling == memcpyCeiling && !latency {
		ceil, err = memcpyBandwidth(cl.spec.newMemory, p.Size, res.iters, 1, p.Duration)
	}
	return res, ceil, err
}
