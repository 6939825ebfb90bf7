"""The trainer: the run's core (`core`), the measuring library (`measure`), the policies, the planner, and the tools
(`estimate`, `export`, `check`, `report`); beside them the few leaves every layer shares (`errors`, `formatting`,
`loss`, `precision`) and the own-loop API (`loop`). docs/layout.md draws the layers; pyproject.toml's import-linter
contracts keep them."""

from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"  # the Hydra config tree train.py composes; one place spells it
