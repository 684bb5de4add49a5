"""Real DeepSpeed engines (CPU accelerator, gloo; graphscale/_adapters/deepspeed): every
engine mix against a plain-PyTorch oracle, training with step() on one and two
ranks, fp16, a backward that raised, DeepSpeed drift, unmanaged accumulation,
compiled autograd, Hugging Face models and Accelerate over engines.

Not named ``deepspeed``: tests/ is on sys.path, and the folder would shadow it."""
