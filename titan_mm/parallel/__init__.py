"""Sharding as data: device meshes (ParallelDims), the plan type, and apply() of any family's plan (TP, EP, CP, PP, AC, compile, FSDP2), with the clip, the memory estimator and batch balance."""
