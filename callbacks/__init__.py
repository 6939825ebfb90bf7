"""The run's Lightning callbacks. Importing the package registers the callbacks a policy brings with it
(`trainer.policies.register_callback`: the planner for `auto`), so `policy.callbacks()` finds them."""

from callbacks import planner as planner  # registers AutoPlanCallback for policy=auto
