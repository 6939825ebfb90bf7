"""Model parallelism beyond FSDP2's data-parallel sharding: tensor parallelism with sequence parallelism
(trainer/parallel/tensor.py), composed with FSDP2 on one 2-D device mesh by the LightningModule's configure_model;
FSDP2's collectives on gloo settled, so a CPU run frees their buffers where FSDP2 drops them
(trainer/parallel/gloo.py); and pipeline stages driven by torch's schedules (trainer/parallel/pipeline.py)."""
