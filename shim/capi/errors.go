package main

/*
#include <stdlib.h>
*/
import "C"

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
// not nil, stores a malloc'd copy of its message there.
func report(errOut **C.char, err error) C.int {
	code := codeOf(err)
	if code == codes.OK {
		return 0
	}
	if errOut != nil {
		*errOut = C.CString(statusMessage(err))
	}
	return C.int(code)
}

// statusMessage is err's message without the status code's prefix.
func statusMessage(err error) string {
	if s, ok := status.FromError(err); ok {
		return s.Message()
	}
	return err.Error()
}
