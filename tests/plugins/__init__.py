"""Workload plug-ins written the way a user would write them (outside the built-ins): the runtime,
profiling and the pipeline must handle them with their defaults. Each `build` returns
`(model, batches, loss_fn)` or a Workload."""
