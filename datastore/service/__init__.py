"""``datastore serve``: the node service, its gRPC protocol (``protos/datastore/v1``) and client.

Layout: ``paths`` (where the socket lives, private directories, stale sockets), ``auth`` (the
shared-secret interceptor for TCP), ``server`` (the servicer and the process around it),
``client`` (channels and calls), ``cli`` (the ``serve`` and ``status`` subcommands), ``_pb``
(generated code).
"""

SERVICE_NAME = "datastore.v1.DataStore"

__all__ = ["SERVICE_NAME"]
