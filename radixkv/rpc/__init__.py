"""What the server and the cluster's router share: gRPC hosting (auth, thread pools, the Unix
socket, signals, the handler wrapper) and etcd membership."""
