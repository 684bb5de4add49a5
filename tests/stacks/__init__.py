"""The other stacks users train with: Accelerate without DeepSpeed, torch DDP and FSDP2
on two gloo ranks, and CUDA devices."""
