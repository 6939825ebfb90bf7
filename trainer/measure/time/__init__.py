"""How long a step takes: its ops traced (`op_trace`, with FLOPs from `flops`), costed by a roofline (`roofline`) at a
device's speed, this CPU's measured once (`calibration`, with ops replayed at their own shapes by `op_replay`) or a
catalogue GPU's, FSDP2's collectives on the GPU link (`collectives`)."""
