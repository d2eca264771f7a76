"""Hybrid data x spatial parallel 3D CNN trainer fed by ``DataStoreLoader`` (trainer issue).

- ``trainer.grid``: :class:`~trainer.grid.ProcessGrid` (data x spatial layout, spatial-fastest,
  spatial and data process groups, neighbours) and :func:`~trainer.grid.init_distributed`.
- ``trainer.halo``: :func:`~trainer.halo.halo_exchange`, differentiable with the exact adjoint.
- ``trainer.layers``: :class:`~trainer.layers.DistConv3d` and gradient helpers.
- ``trainer.cosmology``: synthetic cosmology fields and their HDF5 train/validation files.
- ``trainer.models``: ``CosmoFlow`` and ``UNet3D`` over a layer factory.
- ``trainer.config``, ``trainer.train``, ``trainer.checkpoint``: ``python -m trainer train``.
"""
