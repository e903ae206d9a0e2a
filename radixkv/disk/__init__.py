"""The disk tier below the pool (radixkv/disk/tier.py)."""
