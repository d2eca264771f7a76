"""``datastore serve``: the node service, its gRPC protocol (``protos/datastore/v1``) and client.

Layout: ``paths`` (where the socket lives, private directories, stale sockets, which service a
client calls), ``auth`` (the shared-secret interceptor for TCP), ``calls`` (calls received and
the clients counted in ``Status``), ``server`` (the servicer and the process around it),
``client`` (channels and calls), ``cli`` (the ``serve``, ``status``, ``load`` and ``unload``
subcommands), ``_pb`` (generated code).
"""

SERVICE_NAME = "datastore.v1.DataStore"

__all__ = ["SERVICE_NAME"]
