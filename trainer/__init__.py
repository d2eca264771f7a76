"""Hybrid data x spatial parallel 3D CNN trainer fed by ``DataStoreLoader`` (trainer issue).

- ``trainer.grid``: :class:`~trainer.grid.ProcessGrid` (data x spatial layout, spatial-fastest,
  spatial and data process groups, neighbours) and :func:`~trainer.grid.init_distributed`.
- ``trainer.halo``: :func:`~trainer.halo.halo_exchange`, differentiable with the exact adjoint.
- ``trainer.layers``: :class:`~trainer.layers.DistConv3d` and gradient helpers.
- ``trainer.reduce``: :class:`~trainer.reduce.GradientReducer` (bucketed spatial sum and data
  average of weight gradients, overlapped with backward).
- ``trainer.optim``: :func:`~trainer.optim.lr_at` (scaled LR, warmup, decay), ``LARS``, ``Lion``.
- ``trainer.lion_cub``: :class:`~trainer.lion_cub.LionCub` (majority vote of Lion signs).
"""
