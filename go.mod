module github.com/tensorrpc/tensorrpc

go 1.26.0

require (
	github.com/google/flatbuffers v25.12.19+incompatible
	github.com/klauspost/compress v1.20.3
	golang.org/x/sys v0.49.0
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
)

require (
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/text v0.42.0 // indirect
)
