"""The service core, no gRPC: KVService and its parts."""

from radixkv.service.service import KVService, ServiceConfig

__all__ = ['KVService', 'ServiceConfig']
