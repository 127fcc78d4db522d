package main

/*
#include "tensorrpc.h"
*/
import "C"

import (
	"unsafe"

	"google.golang.org/grpc/codes"

	"github.com/tensorrpc/tensorrpc/rpc"
)

// Rows of a published tensor and fetches into the caller's memory: the C
// side of rpc.Rows, rpc.Into and Client.SendRows (ABI version 4).

// rowsArg copies the caller's nrows row indices at rows into Go; NULL
// and 0 give nil.
func rowsArg(rows *C.trpc_row_index, nrows C.size_t) ([]int64, error) {
	if nrows == 0 {
		return nil, nil
	}
	if rows == nil {
		return nil, errorf(codes.InvalidArgument, "NULL rows for %d rows", uint64(nrows))
	}
	if uint64(nrows) > rpc.MaxRows {
		return nil, errorf(codes.InvalidArgument, "%d rows, more than %d", uint64(nrows), rpc.MaxRows)
	}
	// The caller's array is read only here: Rows and SendRows take copies.
	return append([]int64(nil), unsafe.Slice((*int64)(unsafe.Pointer(rows)), int(nrows))...), nil
}

// fetchClient checks what every fetch takes (a live client, a key, a
// place for the result: haveOut, known flags) and returns the client.
func fetchClient(h C.trpc_client, key *C.char, haveOut bool, flags C.int) (*clientEntry, error) {
	c, err := getClient(h)
	if err != nil {
		return nil, err
	}
	if key == nil || !haveOut {
		return nil, errorf(codes.InvalidArgument, "NULL key or out")
	}
	return c, checkFetchFlags(flags)
}

// checkFetchFlags refuses flags trpc_client_fetch does not know.
func checkFetchFlags(flags C.int) error {
	if flags&^(fetchLease|fetchWait) != 0 {
		return errorf(codes.InvalidArgument, "unknown fetch flags %#x", int(flags))
	}
	return nil
}

// trpc_client_fetch_into fetches the tensor published under key, or
// rows[0:nrows] of it (indices along dimension 0; rows NULL or nrows 0:
// the whole tensor), into dst, the caller's CPU tensor: its dtype and
// shape must be what arrives, else INVALID_ARGUMENT and dst is not
// written. On tcp the bytes go straight into dst's memory (up to 4 MiB
// the server writes them there before it answers, a landing; above, the
// client reads them there); where a
// plane cannot reach caller memory they land in pool memory and are
// copied into dst once (trpc_stats.copies). flags as trpc_client_fetch's
// (TRPC_FETCH_LEASE is ignored: a lease cannot land in dst). When it
// returns nothing writes dst any more: rpc's Fetch Into waits for Reads
// under way when it fails or is given up (tensorrpc.h).
//
//export trpc_client_fetch_into
func trpc_client_fetch_into(h C.trpc_client, key *C.char, dst *C.DLTensor, rows *C.trpc_row_index, nrows C.size_t,
	flags C.int, timeoutMs C.int64_t, errOut **C.char) C.int {
	c, err := fetchClient(h, key, true, flags)
	if err != nil {
		return report(errOut, err)
	}
	idx, err := rowsArg(rows, nrows)
	if err != nil {
		return report(errOut, err)
	}
	t, done, err := input(dst, nil)
	if err != nil {
		return report(errOut, err)
	}
	defer done()
	opts := append(fetchOptions(flags), rpc.Into(t))
	if idx != nil {
		opts = append(opts, rpc.Rows(idx...))
	}
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	// Fetch returns t itself, which stays the caller's (or, for a tensor
	// the shim handed out, its DLManagedTensor's): nothing to release.
	_, err = c.c.Fetch(ctx, C.GoString(key), opts...)
	return report(errOut, err)
}

// trpc_client_fetch_rows fetches rows[0:nrows] (indices along dimension
// 0, in this order, repeats allowed; nrows >= 1) of the tensor published
// under key as a new tensor of shape [nrows, shape[1:]...], in one
// request. An index out of range fails with INVALID_ARGUMENT and nothing
// moves. flags as trpc_client_fetch's (a lease does not apply to rows).
//
//export trpc_client_fetch_rows
func trpc_client_fetch_rows(h C.trpc_client, key *C.char, rows *C.trpc_row_index, nrows C.size_t,
	flags C.int, timeoutMs C.int64_t, out **C.DLManagedTensor, errOut **C.char) C.int {
	c, err := fetchClient(h, key, out != nil, flags)
	if err != nil {
		return report(errOut, err)
	}
	if nrows == 0 {
		return report(errOut, errorf(codes.InvalidArgument, "no rows named (nrows is 0)"))
	}
	idx, err := rowsArg(rows, nrows)
	if err != nil {
		return report(errOut, err)
	}
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	t, err := c.c.Fetch(ctx, C.GoString(key), append(fetchOptions(flags), rpc.Rows(idx...))...)
	if err != nil {
		return report(errOut, err)
	}
	m, err := export(t, nil)
	if err != nil {
		return report(errOut, err)
	}
	*out = m
	return 0
}

// trpc_client_send_rows writes src's rows over rows[0:nrows] (distinct
// indices along dimension 0) of the tensor the server published under
// key with TRPC_PUBLISH_WRITABLE. src has shape [nrows, shape[1:]...] of
// the published tensor and its dtype. Not writable: PERMISSION_DENIED;
// not published: NOT_FOUND; bad rows or shape: INVALID_ARGUMENT; nothing
// is written on an error. The library reads src's memory only until it
// returns (on tcp in place, elsewhere copied into the pool once).
//
//export trpc_client_send_rows
func trpc_client_send_rows(h C.trpc_client, key *C.char, rows *C.trpc_row_index, nrows C.size_t, src *C.DLTensor,
	timeoutMs C.int64_t, errOut **C.char) C.int {
	c, err := getClient(h)
	if err != nil {
		return report(errOut, err)
	}
	if key == nil {
		return report(errOut, errorf(codes.InvalidArgument, "NULL key"))
	}
	idx, err := rowsArg(rows, nrows)
	if err != nil {
		return report(errOut, err)
	}
	t, done, err := input(src, nil)
	if err != nil {
		return report(errOut, err)
	}
	defer done()
	ctx, cancel := callContext(timeoutMs)
	defer cancel()
	return report(errOut, c.c.SendRows(ctx, C.GoString(key), idx, t))
}
