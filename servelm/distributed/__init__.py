"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

parallel_state  process groups on a c10d store; collectives; torchrun's environment
sharding        ShardPlan (which heads / rows / vocabulary each rank holds), the parallel
                modules, shard_model (applied after the model is built, before loading)
worker          one rank's life: load its shard, allocate its KV pool, run broadcast steps
executor        TPExecutor (an engine Executor): rank 0's shard; spawns or joins the other ranks
"""
