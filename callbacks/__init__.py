"""The run's Lightning callbacks. A policy that needs one names it (`Capabilities.brings`, e.g. auto's planner), so
importing this package registers nothing."""
