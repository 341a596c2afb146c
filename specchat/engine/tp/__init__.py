"""Tensor parallelism (Megatron-style) over torch.distributed: one model split over the GPUs of a node.

shard.py   which slice of each weight a rank holds (dense and MXFP4), and the checks on the shapes
layers.py  RowParallel (all-reduce) and VocabParallelHead (all-gather), swapped into a rank's model
group.py   the rendezvous and the two process groups (control: gloo; compute: NCCL on CUDA, gloo on the CPU)
load.py    one rank's shard: checkpoint read, sliced, built, weight format applied
messages.py what rank 0 sends the workers each step (ForwardPlan, page copies, format switches)
leader.py  what rank 0 adds to an ordinary Engine so that the workers follow it
worker.py  a worker rank's loop
launch.py  TPEngine: starts the workers (spawn or torchrun) and builds rank 0's engine
"""
