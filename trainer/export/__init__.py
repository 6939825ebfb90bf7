"""A plan of ours as another trainer's own settings: torchtitan, Megatron, Hugging Face, Lightning, torchtune.

    python -m trainer.export --to megatron policy=first_k policy.k=2 model=llama-tiny
    python -m trainer.export --to torchtitan policy=op_sac --json export.json
    python -m trainer.export --to hf policy=full loss=chunked --out training_args.py

The same Hydra overrides as train.py compose the same config; a planned policy (auto) is planned first, as the
estimator plans it. For the target chosen the command prints the settings its users paste (names for the release
they were read from, and whether that package is installed here), a fidelity row per element of our plan and the
loss head (exact / approximated, and how / not expressible), and where a row is not exact, the estimator's figures
for our plan and for the closest plan the target can write, side by side. A plan the target cannot express at all,
an unknown target or an option the chosen version lacks is one line naming what would work, exit 2, nothing written.

Inside: `spec` (the plan's elements, a target's candidates and the `Target` base with the registry), `targets` (one
module per target), `fidelity` (the closest plan, the rows, the figures) and `cli` (this command).
"""

from trainer.export import targets as _targets  # noqa: F401  (registers them)
from trainer.export.cli import ExportResult, build_context, export, main, render, to_json
from trainer.export.fidelity import PlanFigures, Row, TargetSettings
from trainer.export.spec import TARGETS, Candidate, ExportInput, ExportRefused, Target

__all__ = [
    "TARGETS",
    "ExportResult",
    "Candidate",
    "ExportInput",
    "ExportRefused",
    "PlanFigures",
    "TargetSettings",
    "Row",
    "Target",
    "build_context",
    "export",
    "main",
    "render",
    "to_json",
]
