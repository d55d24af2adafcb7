"""Platform-neutral core: scheduler, KV-cache manager, sampler, engine, models."""
