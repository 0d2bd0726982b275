"""The scheduler process's policy side: the event loop (``scheduler``), the batch planner
(``planner``), the waiting order, preemption, the prefix cache over the radix tree, request
state and stop checks. ``decision`` holds the scheduler <-> executor contract (the plan the
executor runs and the results it hands back).

The planner, waiting order, preemption and prefix cache import no torch: scheduling
policies are tested on the CPU without a model.
"""
