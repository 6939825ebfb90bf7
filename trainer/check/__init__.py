"""`python -m trainer.check`: is a policy exact on my model? The comparison lives in `compare`."""

from trainer.check.compare import CheckResult, Difference, compare_step, group_of, main, render, run_check

__all__ = ["CheckResult", "Difference", "compare_step", "group_of", "main", "render", "run_check"]
