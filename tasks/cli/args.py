"""The CLI's value types for argparse: core's strict checks (tasks.core.limits) adapted, so each
value is checked fully at parse time, before anything starts, in the same words the flow's
parameter models use."""
from __future__ import annotations

from tasks.core import limits
from tasks.core.catalog import known_region
from tasks.core.command_line import arg_type

counts = arg_type(limits.counts)
positive_float = arg_type(limits.positive_float)
mbps = arg_type(limits.mbps)
positive_floats = arg_type(limits.positive_floats)
nonnegative_float = arg_type(limits.nonnegative_float)
finite_float = arg_type(limits.finite_float)
positive_int = arg_type(limits.positive_int)
positive_count = arg_type(limits.positive_count)
batch_size = arg_type(limits.batch_size)
seed = arg_type(limits.seed)
duration_s = arg_type(limits.duration_s)
nonnegative_duration_s = arg_type(limits.nonnegative_duration_s)
time_window_s = arg_type(limits.time_window_s)
identifier = arg_type(limits.identifier)
output_file = arg_type(limits.output_file)
output_dir = arg_type(limits.output_dir)
endpoint_url = arg_type(limits.endpoint_url)
region = arg_type(known_region)
