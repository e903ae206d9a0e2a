"""What an engine imports: the gRPC client and its lease handle."""

from radixkv.client.client import STORE_ALL, Client, pool_info_from_pb

__all__ = ['Client', 'STORE_ALL', 'pool_info_from_pb']
