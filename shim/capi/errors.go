package main

/*
#include <stdlib.h>
#include "tensorrpc.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
)

// errorf makes an error carrying a status code.
func errorf(code codes.Code, format string, args ...any) error {
	return status.Error(code, "tensorrpc: "+fmt.Sprintf(format, args...))
}

// codeOf is the status code the C caller sees for err: its gRPC code, the
// context's code, or Unknown.
func codeOf(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	if s, ok := status.FromError(err); ok {
		return s.Code()
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	}
	return codes.Unknown
}

// report returns err's status code and, when errOut is not NULL and err is
// not nil, stores a malloc'd copy of its message there. A failure also
// replaces the calling thread's error details (trpc_error_details) with
// err's, or none. It must run on the thread of the C caller (in the
// exported function's goroutine), as every exported function calls it.
func report(errOut **C.char, err error) C.int {
	code := codeOf(err)
	if code == codes.OK {
		return 0
	}
	if errOut != nil {
		*errOut = C.CString(statusMessage(err))
	}
	var details *C.char
	if d := errorDetails(err); d != "" {
		details = C.CString(d)
	}
	C.trpc_set_error_details(details)
	return C.int(code)
}

// withDetails is a status error of code and msg that carries details (a
// handler's traceback, say) as a google.rpc.DebugInfo, which gRPC sends in
// the status's details while the message stays short.
func withDetails(code codes.Code, msg, details string) error {
	st := status.New(code, msg)
	if details == "" {
		return st.Err()
	}
	ds, err := st.WithDetails(&errdetails.DebugInfo{Detail: details})
	if err != nil {
		return st.Err()
	}
	return ds.Err()
}

// errorDetails is the text of the DebugInfo details of err's status, or "".
func errorDetails(err error) string {
	s, ok := status.FromError(err)
	if !ok {
		return ""
	}
	var parts []string
	for _, d := range s.Details() {
		if di, ok := d.(*errdetails.DebugInfo); ok {
			if di.Detail != "" {
				parts = append(parts, di.Detail)
			} else if len(di.StackEntries) > 0 {
				parts = append(parts, strings.Join(di.StackEntries, "\n"))
			}
		}
	}
	return strings.Join(parts, "\n")
}

// statusMessage is err's message without the status code's prefix.
func statusMessage(err error) string {
	msg := err.Error()
	if s, ok := status.FromError(err); ok {
		msg = s.Message()
	}
	// Advice that names Go's API, in the C ABI's terms (the Python
	// package puts its own in place of these).
	return strings.Replace(msg, rpc.WaitHint, waitHint, 1)
}

// waitHint is rpc.WaitHint for C callers.
const waitHint = "(to wait for it, fetch with the flag TRPC_FETCH_WAIT)"
