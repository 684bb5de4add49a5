"""What users do beside graphscale: other hooks, torch.compile, threads and concurrent
backwards, huge graphs, long runs, gc.freeze, and every misuse."""
