"""Hybrid data x spatial parallel 3D CNN trainer fed by ``DataStoreLoader`` (trainer issue).

- ``trainer.grid``: :class:`~trainer.grid.ProcessGrid` (data x spatial layout, spatial-fastest,
  spatial and data process groups, neighbours) and :func:`~trainer.grid.init_distributed`.
- ``trainer.halo``: :func:`~trainer.halo.halo_exchange`, differentiable with the exact adjoint.
- ``trainer.layers``: :class:`~trainer.layers.DistConv3d` (any stride) and gradient helpers.
- ``trainer.pool``: :class:`~trainer.pool.DistMaxPool3d`, :class:`~trainer.pool.DistAvgPool3d`,
  :func:`~trainer.pool.global_avg_pool` and :func:`~trainer.pool.gather_flatten`.
- ``trainer.norm``: :class:`~trainer.norm.DistBatchNorm3d`, statistics over an explicit group.
- ``trainer.geometry``: pure block geometry of the strided and overlapped layers.
- ``trainer.agree``: the spatial group agrees once per new input shape, so a block one rank
  refuses raises on every rank before any halo moves.
- ``trainer.comm``: every message, direct (gloo on CPU, NCCL on GPU) or staged through pinned
  host memory (CUDA over gloo), with a timeout; ``trainer.devices``: the rank's device and
  backend.
- ``trainer.reduce``: :class:`~trainer.reduce.GradientReducer` (bucketed spatial sum and data
  average of weight gradients, overlapped with backward).
- ``trainer.optim``: :func:`~trainer.optim.lr_at` (scaled LR, warmup, decay), ``LARS``, ``Lion``.
- ``trainer.lion_cub``: :class:`~trainer.lion_cub.LionCub` (majority vote of Lion signs).
- ``trainer.cosmology``: synthetic cosmology fields and their HDF5 train/validation files.
- ``trainer.models``: ``CosmoFlow`` and ``UNet3D`` over a layer factory.
- ``trainer.preflight``: pure checks of a run (fields, world, the model's blocks at every level);
  ``trainer.start``: device, process group and those checks agreed on by every rank.
- ``trainer.metrics``: the tasks' losses and validation sums.
- ``trainer.config``, ``trainer.train``, ``trainer.checkpoint``: ``python -m trainer train``;
  ``trainer/configs/*.toml``: an example per model.
- ``trainer.tournament``: ``python -m trainer tournament`` (LTFB: trainers, one process each,
  on one ``datastore serve``, the losers of each round taking their winners' state).
"""
