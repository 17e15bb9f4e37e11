"""The engine: sequences -> block manager -> scheduler -> model runner -> sampler -> outputs."""
