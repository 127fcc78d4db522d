// Package proto holds the tensorrpc wire schemas: the gRPC control-plane
// service (tensorrpc.proto, generated into proto/tensorrpcpb), and the tensor
// wire header and the data-plane frame header (header.fbs, generated into
// proto/wirefb). Package proto/wire encodes and validates both headers.
//
// Run `go generate ./proto/...` to regenerate the Go code; gen.sh pins the
// generator versions.
package proto

//go:generate bash gen.sh
