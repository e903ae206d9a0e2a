"""Generated stubs for the subset of etcd's v3 gRPC API radixkv uses (proto/radixkv/etcd/)."""
