"""Model parallelism beyond FSDP2's data-parallel sharding: tensor parallelism with sequence parallelism
(trainer/parallel/tensor.py), composed with FSDP2 on one 2-D device mesh by the LightningModule's configure_model."""
