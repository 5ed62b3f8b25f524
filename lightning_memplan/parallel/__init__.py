"""The planning/applying core shared by the Trainer's ``MemplanAutoStrategy`` and Fabric's
``MemplanAutoFabricStrategy``: one file per technique (torchtitan's ``distributed/`` layout): mesh axes,
FSDP2/DDP, tensor parallel, pipeline parallel, activation checkpointing, and the decision's resolution
and record. What a live module, trainer, optimizer and batch say about the run (and where a module keeps
its blocks, :func:`~lightning_memplan.live.find_layout`) is read through :mod:`lightning_memplan.live`,
the package below this one.

The two front doors (:mod:`lightning_memplan.strategies`, :mod:`lightning_memplan.fabric`) are thin
adapters over these modules; nothing here imports either of them.
"""
