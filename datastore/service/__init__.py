"""``datastore serve``: the node service, its gRPC protocol (``protos/datastore/v1``) and client.

Layout: ``paths`` (where the socket lives, private directories, stale sockets, which service a
client calls), ``auth`` (the shared-secret interceptor for TCP), ``calls`` (calls received and
the clients counted in ``Status``), ``config`` (what ``serve`` was asked for), ``servicer``
(the ``DataStore`` calls), ``listeners`` (the gRPC servers, their ports and services),
``server`` (the process: start-up, signals, drain), ``client`` (channels and calls), ``cli``
(the ``serve``, ``status``, ``load``, ``unload`` and ``shutdown`` subcommands' arguments),
``commands`` (what they do), ``status_table`` (``status`` for people), ``_pb`` (generated code).
"""

SERVICE_NAME = "datastore.v1.DataStore"

__all__ = ["SERVICE_NAME"]
