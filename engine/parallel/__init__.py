"""Tensor parallelism: a model split over N rank processes (Megatron's way). `shard.py` what a
rank holds; `group.py` its collectives; `step_channel.py` each step's inputs handed to the
ranks once; `executor.py` rank 0's side (spawning, commands, the step); `worker.py` the
other ranks' process."""
