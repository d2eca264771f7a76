"""Where a loader's batches come from; each source fills (or hands over) batch buffers.

- :class:`~datastore.sources.local.LocalSource`: this rank reads the blocks it needs and keeps
  them in its store.
- :class:`~datastore.sources.mpi.MpiExchange` and
  :class:`~datastore.sources.torch_dist.TorchExchange`: every rank owns a share of the
  samples; owners send each consumer exactly its blocks at every step (MPI, or
  ``torch.distributed`` with gloo under torchrun).
- :class:`~datastore.sources.service.ServiceSource`: ``datastore serve`` streams the batches.

The loader opens one source: an :class:`~datastore.sources.embedded.EmbeddedSource` (a
``LocalSource`` or an :class:`~datastore.sources.embedded.ExchangeSource`, each owning its store,
and the exchange its plan) or a ``ServiceSource``; all give ``batches(epoch, start, stop,
ring)``, ``counters``, ``session_id``, ``steps_together`` and ``close()``.
:func:`~datastore.sources.describe.describe_dataset` tells a dataset's samples and fields as
either sees it.

Their settings are :class:`~datastore.sources.options.StoreOptions`,
:class:`~datastore.sources.options.ExchangeOptions` and
:class:`~datastore.sources.options.ServiceOptions` (``DataStoreLoader``'s ``store=``,
``exchange=`` and ``service=``).

Sources receive buffers (:class:`~datastore.store.ring.Buffer`) and never call back into the loader.
"""
