"""Generated protobuf and gRPC code for protos/wafl/v1 (python -m wafl.common.protogen)."""
