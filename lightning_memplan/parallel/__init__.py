"""The planning/applying core shared by the Trainer's ``MemplanAutoStrategy`` and Fabric's
``MemplanAutoFabricStrategy``: one file per technique (torchtitan's ``distributed/`` layout): mesh axes,
FSDP2/DDP, tensor parallel, pipeline parallel, activation checkpointing, the layout recogniser, the
decision's resolution and record, and :mod:`~lightning_memplan.parallel.infer` (what a live module,
trainer, optimizer and batch say about the run).

The two front doors (:mod:`lightning_memplan.strategies`, :mod:`lightning_memplan.fabric`) are thin
adapters over these modules; nothing here imports either of them.
"""
