"""Beyond one node: etcd membership, the cluster-wide prefix index and the cache-aware router."""
