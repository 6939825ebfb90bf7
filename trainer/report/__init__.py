"""`python -m trainer.report`: a sweep's table, Pareto plot and loss curves. Reading the jobs and writing the report
is `sweep`; the figures are `plots`."""

from trainer.report.sweep import Job, Report, build_report, main, read_jobs, read_scalars

__all__ = ["Job", "Report", "build_report", "main", "read_jobs", "read_scalars"]
