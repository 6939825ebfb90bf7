"""The targets, one module each; importing this package registers them in `trainer.export.spec.TARGETS`, the one
list of targets (in import order: what `--to` lists)."""

from trainer.export.targets import hf, lightning, megatron, torchtitan, torchtune

__all__ = ["hf", "lightning", "megatron", "torchtitan", "torchtune"]
