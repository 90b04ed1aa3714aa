"""Running a layer: plans (head grouping), executors, and the guarded compiled flex_attention call."""
