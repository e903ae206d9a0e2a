"""The gRPC side of the service: the servicer (thin handlers over `radixkv.service`), the
server process (`app`), its configuration, metrics, and `launch` (a server in a subprocess, for
tools and tests)."""
